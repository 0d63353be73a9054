"""The script of a %%ddp_train or %%ddp_exec cell, made from the cells the kernel ran (no kernel, no rank here)."""

from __future__ import annotations

from nbddp.doors.jupyter.kernel_cells import CellHistory, build_script
from nbddp.plan.options import LaunchOptions

SETUP = "#| ddp\nimport torch, nbddp\nmodel = torch.nn.Linear(1, 1)"


def _history() -> CellHistory:
    history = CellHistory()
    history.record(SETUP, "setup", (), 1)
    return history


def test_an_exec_cell_for_some_ranks_keeps_its_lines_and_its_strings_and_returns_nothing():
    body = 'text = """a\nb"""\nprint(text)'
    script, _ = build_script(_history(), body, {}, LaunchOptions(), 2, label="the %%ddp_exec cell",
                             only_ranks=(1,), returns=())
    compile(script.text, "train.py", "exec")
    assert "get_rank() in (1,):" in script.text and '        text = """a\nb"""\n        print(text)' in script.text
    assert "# Weights: none come back." in script.text
    assert script.returns == ()
    # the body's line 2 (the string's second line) and line 3 keep their numbers in the cell
    lines = script.text.split("\n")
    printed = next(n for n, line in enumerate(lines, start=1) if line.strip() == "print(text)")
    assert script.source_map.where(printed) == "the %%ddp_exec cell, line 4"  # (line 1: the magic's)


def test_an_exec_cell_of_comments_alone_needs_no_test_of_the_rank():
    script, _ = build_script(_history(), "# nothing yet", {}, LaunchOptions(), 2, only_ranks=(0,), returns=())
    compile(script.text, "train.py", "exec")
    assert "get_rank()" not in script.text
