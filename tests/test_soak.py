"""The short soak: small 2-rank runs through `nbddp run`, `%%ddp_train` and `nbddp batch`, two jobs at
once. A run whose ranks all finished must succeed, and nothing may be left or lost.

The long version (`python -m benchmarks.soak --runs 200`) writes its figures to docs/reliability.md.
"""

import pytest

from benchmarks.soak import FRONTS, soak

pytestmark = [pytest.mark.slow, pytest.mark.beside]  # (long, no timing asserted: .ci/run's beside lane)


@pytest.mark.timeout(900)
def test_short_soak_under_contention(tmp_path):
    # Six runs: each front door's job once (`nbddp run`, three %%ddp_train cells, a two-run batch), two jobs at
    # a time on 2 cores (in .ci/run, beside the other lanes: no CPU hog of its own). The 200-run soak
    # (docs/reliability.md, with a hog) is where the rare races are counted.
    report = soak(tmp_path / "soak", runs=6, parallel=2, hogs=0, lines=30)
    summary = report.markdown("tests/test_soak.py")
    assert len(report.runs) >= 6 and {r.front for r in report.runs} == set(FRONTS), summary
    assert not report.spurious_failures, summary
    assert not report.failures, summary
    assert report.leftover_processes == [], summary
    assert report.leftover_temp == [], summary
    assert report.lines_lost == 0, summary
