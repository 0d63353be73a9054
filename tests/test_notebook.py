"""Reading notebooks: bad files fail with the path and write nothing."""

import json
import re

import pytest

from nbddp.doors.cli import main
from nbddp.contracts.errors import NotebookError
from nbddp.notebook.reader import read_notebook
from tests.conftest import code, md

NB = {"metadata": {}, "nbformat": 4, "nbformat_minor": 5}
CELL = {"cell_type": "code", "id": "a", "metadata": {}, "source": "x = 1", "outputs": [], "execution_count": None}


def test_cells_are_numbered_in_notebook_order_markdown_included(notebook):
    nb = read_notebook(notebook([md("# hi"), code("x = 1", "ddp"), md("more"), code("y = 2")]))
    assert [(c.number, c.cell_type) for c in nb.cells] == [(1, "markdown"), (2, "code"), (3, "markdown"), (4, "code")]
    assert nb.cells[1].tags == ("ddp",)


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"cells": [', "not valid notebook JSON"),
        ("not json at all", "not valid notebook JSON"),
        ('{"a": 1}', "not a Jupyter notebook"),
        (json.dumps({"cells": [], "metadata": {}, "nbformat": 3, "nbformat_minor": 0}), "nbformat version 3 is not supported"),
        (json.dumps({"cells": [], "metadata": {}, "nbformat": 5, "nbformat_minor": 0}), "nbformat version 5 is not supported"),
        (json.dumps({"cells": [{"cell_type": "code"}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}), "invalid notebook"),
        # what nbformat would meet as a TypeError or a RecursionError from deep inside it: named by its cell
        (json.dumps(NB | {"cells": [CELL | {"source": ["import torch\n", 5]}]}), "cell 1's source holds 5 (int)"),
        (json.dumps(NB | {"cells": [CELL, 7]}), "cell 2 is 7, not a cell"),
        (json.dumps(NB | {"cells": {"a": CELL}}), "'cells' is a dict, not a list of cells"),
        (json.dumps(NB | {"cells": [CELL, CELL | {"metadata": {"tags": "ddp"}}]}),
         "invalid notebook (cell 2's metadata.tags): 'ddp' is not of type 'array'"),
        ('{"cells": [], "nbformat": 4, "metadata": {"x": ' + "[" * 100000 + "]" * 100000 + "}}", "nested too deeply"),
    ],
)
def test_bad_files_name_the_path_and_write_nothing(tmp_path, capsys, text, expected):
    path = tmp_path / "bad.ipynb"
    path.write_text(text)
    with pytest.raises(NotebookError, match=re.escape(expected)) as info:
        read_notebook(path)
    assert str(path) in str(info.value)
    out = tmp_path / "train.py"
    assert main(["export", str(path), "-o", str(out)]) == 2
    assert expected in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "train.py.map.json").exists()


def test_missing_file(tmp_path):
    with pytest.raises(NotebookError, match="no such notebook"):
        read_notebook(tmp_path / "nope.ipynb")
