"""A job's script cut into the units a warm rank runs: nbddp's lines and literal parameters, each setup cell
with its own line numbers, the training last (nbddp's own script generator writes them)."""

from __future__ import annotations

from nbddp.notebook.reader import read_notebook
from nbddp.notebook.script import ExportOptions, generate, write_script
from nbddp.rank_side.warm.script_units import CELL, LITERAL, TRAIN, units_of
from tests.conftest import code, write_notebook


def script_of(tmp_path, parameters_cell: str, overrides: dict | None = None):
    notebook = write_notebook(tmp_path / "nb.ipynb", [
        code(parameters_cell, "parameters"),
        code("#| ddp\nimport torch\nmodel = torch.nn.Linear(2, int(width))"),
        code("#| ddp\nrows = torch.randn(8, 2)\n\ndef loss(m):\n    return m(rows).sum() * lr"),
        code("#| ddp-train\nloss(model).backward()"),
    ])
    script = generate(read_notebook(notebook), ExportOptions(parameters=overrides or {}))
    path, _ = write_script(script, tmp_path / "train.py")
    return units_of(path), path.read_text().split("\n")


def test_setup_cells_keep_their_lines_and_say_what_they_read(tmp_path):
    units, lines = script_of(tmp_path, "width = 3\nlr = 0.1", {"lr": 0.5})
    assert [u.kind for u in units] == [LITERAL, LITERAL, LITERAL, CELL, CELL, TRAIN]
    first, second = (u for u in units if u.kind == CELL)
    assert (first.name, second.name) == ("cell 2", "cell 3")
    assert lines[first.first_line - 1:first.first_line + 1] == ["#| ddp", "import torch"]
    assert min(line for _, _, line in first.code.co_lines() if line) == first.first_line + 1  # the script's numbers
    assert {"torch", "width"} <= first.reads and {"lr", "rows", "torch"} <= second.reads  # (a function's reads too)
    assert first.imports == (("torch", "torch"),)
    namespace: dict = {}
    for unit in units[:-1]:
        exec(unit.code, namespace)
    assert namespace["lr"] == 0.5 and namespace["model"].out_features == 3


def test_a_parameters_cell_that_computes_is_a_setup_cell_and_a_script_of_another_shape_is_none(tmp_path):
    units, _ = script_of(tmp_path, "width = 3\nlr = 0.1 * width")
    assert [u.kind for u in units] == [LITERAL, CELL, CELL, CELL, TRAIN]
    (tmp_path / "plain.py").write_text("print('no guard, no map')\n")
    assert units_of(tmp_path / "plain.py") is None
