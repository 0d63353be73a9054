"""Reading notebooks: bad files fail with the path and write nothing."""

import json

import pytest

from nbddp.doors.cli import main
from nbddp.errors import NotebookError
from nbddp.notebook.reader import read_notebook
from tests.conftest import code, md


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
    ],
)
def test_bad_files_name_the_path_and_write_nothing(tmp_path, capsys, text, expected):
    path = tmp_path / "bad.ipynb"
    path.write_text(text)
    with pytest.raises(NotebookError, match=expected) as info:
        read_notebook(path)
    assert str(path) in str(info.value)
    out = tmp_path / "train.py"
    assert main(["export", str(path), "-o", str(out)]) == 2
    assert expected in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "train.py.map.json").exists()


def test_missing_file(tmp_path):
    with pytest.raises(NotebookError, match="no such notebook"):
        read_notebook(tmp_path / "nope.ipynb")
