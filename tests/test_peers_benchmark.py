"""The peers benchmark's report (benchmarks/peers.py): how a row's values read, without running a peer."""

import ast

from benchmarks.peers import ENDINGS, ROWS, Tool, accelerate_tool, markdown, nbddp_tool, summary


def test_a_rows_values_read_as_a_median_a_breakage_or_liveness():
    assert summary([0.2, 0.1, 0.3]) == "0.20 s (0.10–0.30)"
    assert summary([0.25, None]) == "0.25 s; **broken** in 1 of 2"
    assert summary([0.25, None, None]) == "0.25 s; **broken** in 2 of 3"
    assert summary([None]).startswith("**broken**: the next run failed")  # measured once: it broke
    assert summary([]) == "n/a"
    assert summary([True, True]) == "live text" and summary([False]) == "**none until the cell ends**"


def test_every_tool_is_given_the_same_cases_and_its_cells_are_python():
    for tool in (nbddp_tool(), accelerate_tool()):
        assert set(tool.cell) == set(ENDINGS)
        for cell in [*tool.setup[1:], *tool.cell.values()]:
            ast.parse(cell.split("\n", 1)[1] if cell.startswith("%%") else cell)


def test_the_report_has_a_row_for_each_figure_and_a_column_for_each_tool():
    tools = [Tool("a", [], {}), Tool("b", [], {}, notes=["it broke"])]
    figures = {"a": {row: [0.1] for row in ROWS}, "b": {row: [] for row in ROWS}}
    text = markdown(figures, 1, tools)
    assert "| | a | b |" in text and all(f"| {row} |" in text for row in ROWS) and "b: it broke" in text


def test_the_setup_cell_rows_give_every_tool_python_cells_and_say_what_was_not_measured(tmp_path):
    from benchmarks.peers import setup_markdown, setup_tools

    tools = setup_tools(tmp_path)
    assert len(tools) == 4 and (tmp_path / "peer_setup_train.py").exists()
    ast.parse((tmp_path / "peer_setup_train.py").read_text())
    for setup, train, digest in tools.values():
        for cell in [*setup, train, digest]:
            if cell and not cell.startswith(("!", "%load_ext", "%dist_init")):
                ast.parse(cell.split("\n", 1)[1] if cell.startswith("%%") else cell)
    text = setup_markdown({"a": {"seconds": [0.3, 0.4], "same": [True, True]},
                           "b": {"seconds": [0.1], "same": [False]}, "c": {"missing": ["not installed"]}}, 2)
    assert "| a | 0.35 s (0.30–0.40) | yes, byte for byte |" in text
    assert "| b | 0.10 s | **no**: 1 of 1 re-runs differ |" in text and "| c | not measured here: not installed | — |" in text


def test_the_first_run_rows_say_a_tool_that_failed_every_time_and_its_first_note_once():
    from benchmarks.first_run import first_markdown, first_rows

    tools = [Tool("a", [], {}), Tool("b", [], {}, notes=["timed out 1", "timed out 2"])]
    rows = first_rows(2)
    figures = {"a": {row: [1.2, 0.8, 1.0] for row in rows}, "b": {row: [None, None] for row in rows}}
    text = first_markdown(figures, 3, tools, busy=2)
    assert len(rows) == 3 and "2 processes busy beside" in rows[2] and len(first_rows(0)) == 2
    assert all(f"| {row} | 1.00 s (0.80–1.20) | **failed** every time (see below) |" in text for row in rows)
    assert "b (2 times): timed out 1" in text and "timed out 2" not in text
    assert "`python -m benchmarks.peers --first-run --rounds 3`" in text and "busy processes spin" in text


def test_where_the_first_run_goes_has_a_row_per_import_phase_and_per_event_for_both_kernels():
    from benchmarks.first_run import EVENTS, PHASES, where_markdown

    imports = {mode: [{"phases": [0.1, 1.0, 0.1, 0.8], "collecting": 0.5 if mode == "on" else 0.0}] for mode in ("on", "off")}
    timeline = {event: float(number) for number, event in enumerate(EVENTS)} | {"training cell sent": 1.5}
    text = where_markdown(imports, {"python3": [timeline], "nbddp": [timeline]}, 1)
    assert all(f"| {phase} | " in text for phase in PHASES) and "| in all | 2.00 s | 2.00 s |" in text
    assert "| of which the collector's own collections | 0.50 s | 0.00 s |" in text
    assert all(f"| {event} | " in text for event in EVENTS) and "| **the training cell** (sent → idle) | 3.50 s | 3.50 s |" in text
