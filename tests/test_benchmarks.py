"""The benchmark suite's harness, in its quick mode: that it runs and reports every figure, not the timings
(those are in BENCHMARKS.md, from a full run).

It runs every benchmark once (about 25 real runs, 4 minutes), so it belongs with the benchmarks, not with
every change: ``python3 -m pytest -m bench`` (before ``python -m benchmarks.suite``); ``.ci/run`` leaves it out.
"""

import pytest

from benchmarks.suite import main

pytestmark = [pytest.mark.slow, pytest.mark.bench]


def test_the_suite_measures_every_figure_in_quick_mode(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    assert main(["--quick", "--out", str(out)]) == 0
    text = out.read_text()
    for section in ("## 1. Start", "## 2. Training throughput", "## 3. Log streaming", "## 4. Returning the model",
                    "## 5. The light paths", "## 6. `nbddp batch` on warm ranks"):
        assert section in text, text
    for case in ("torchrun by hand", "exported script under torchrun", "nbddp run", "%%ddp_train --fresh", "%%ddp_train, 1st run (warm ranks forked from the starter %load_ext started)",
                 "%%ddp_train warm, 2nd run", "%%ddp_train warm, 10th run", "import nbddp", "nbddp export (200 cells)",
                 "--fresh", "warm ranks"):
        assert f"| {case} |" in text, text
    assert "n/a" not in text
    assert text.count(" | 0 | ") == 2, text  # no streamed line lost, in the terminal and in the cell

