"""Cell roles (tags and directives) and IPython syntax in exported cells."""

import pytest

from nbddp.notebook.cells import cell_role, export_cell, select_cells
from nbddp.contracts.errors import CellError, NotebookError
from nbddp.notebook.reader import Cell, read_notebook
from tests.conftest import code, md


def cell(source, *tags, number=3):
    return Cell(number, "code", source, tuple(tags))


@pytest.mark.parametrize(
    "source, tags, role",
    [
        ("x = 1", ("parameters",), "parameters"),
        ("x = 1", ("injected-parameters",), "injected-parameters"),
        ("import torch", ("ddp",), "ddp"),
        ("train()", ("ddp-train",), "ddp-train"),
        ("#| ddp\nimport torch", (), "ddp"),
        ("#|ddp-train\ntrain()", (), "ddp-train"),
        ("\n#| parameters\nx = 1", (), "parameters"),
        ("#| ddp\nx = 1", ("ddp",), "ddp"),  # tag and directive agree
        ("%%ddp_train --cpu\ntrain()", (), "ddp-train"),
        ("print('explore')", ("other-tag",), None),
        ("#| export\nx = 1", (), None),  # someone else's (nbdev) directive
        ("# | ddp is mentioned in a comment", (), None),
    ],
)
def test_roles_from_tags_and_directives(source, tags, role):
    assert cell_role(cell(source, *tags)) == role


def test_markdown_cells_have_no_role():
    assert cell_role(Cell(1, "markdown", "#| ddp", ())) is None


def test_conflicting_roles_are_an_error():
    with pytest.raises(CellError, match="cell 3 has conflicting roles"):
        cell_role(cell("#| ddp-train\nx", "ddp"))


def test_misspelt_directive_is_an_error_naming_the_right_ones():
    with pytest.raises(CellError, match=r"cell 3, line 1: unknown directive '#\| ddp-trian'.*#\| ddp-train"):
        cell_role(cell("#| ddp-trian\nx = 1"))


def test_no_training_cell_names_the_tags_to_add(notebook):
    path = notebook([code("import torch", "ddp"), code("print(1)")])
    with pytest.raises(NotebookError, match="no training cell.*'ddp-train'.*'#| ddp-train'.*%%ddp_train"):
        select_cells(read_notebook(path))


def test_selected_in_notebook_order_untagged_and_markdown_dropped(notebook):
    path = notebook([
        md("# title"),
        code("lr = 1", "parameters"),
        code("print('explore')"),
        code("#| ddp-train\ntrain()"),
        code("#| ddp\nimport torch"),
    ])
    selected = select_cells(read_notebook(path))
    assert [(c.cell.number, c.role) for c in selected] == [(2, "parameters"), (4, "ddp-train"), (5, "ddp")]


def test_inert_magics_and_shell_lines_are_commented_with_a_note():
    source = "%matplotlib inline\n%load_ext autoreload\n!pip install foo\nimport os\nx?\n    "
    exported = export_cell(cell(source), "ddp", "nb.ipynb")
    lines = exported.code.split("\n")
    assert lines[0] == "# %matplotlib inline  # nbddp: %matplotlib has no meaning in a script"
    assert lines[1].startswith("# %load_ext autoreload  # nbddp:")
    assert lines[2].startswith("# !pip install foo  # nbddp: shell command not run by the ranks")
    assert lines[3] == "import os"
    assert lines[4].startswith("# x?  # nbddp:")
    assert len(lines) == len(source.split("\n"))  # one script line per cell line: the source map relies on it


def test_continued_shell_line_keeps_the_line_count():
    exported = export_cell(cell("!echo a \\\n  b\ny = 1"), "ddp", "nb.ipynb")
    assert exported.code.split("\n") == [
        "# !echo a \\  # nbddp: shell command not run by the ranks (it runs only in the notebook)",
        "# b",
        "y = 1",
    ]


def test_time_magic_keeps_its_statement_even_indented():
    exported = export_cell(cell("for i in range(2):\n    %time y = i * 2\n"), "ddp-train", "nb.ipynb")
    assert exported.code.split("\n")[1] == "    y = i * 2  # nbddp: %time dropped"
    namespace = {}
    exec(exported.code, namespace)
    assert namespace["y"] == 2


def test_cell_magic_time_is_dropped_and_body_kept():
    exported = export_cell(cell("%%time\nz = 3"), "ddp", "nb.ipynb")
    namespace = {}
    exec(exported.code, namespace)
    assert namespace["z"] == 3


def test_ddp_train_magic_body_is_exported_with_its_line_offset():
    exported = export_cell(cell("%%ddp_train --cpu --nproc 2\nfor i in range(2):\n    pass"), "ddp-train", "nb.ipynb")
    assert exported.code == "for i in range(2):\n    pass"
    assert exported.first_line == 2 and exported.magic_args == "--cpu --nproc 2"


@pytest.mark.parametrize(
    "source, line, text",
    [
        ("import os\nfiles = !ls", 2, "files = !ls"),
        ("x = %pwd", 1, "x = %pwd"),
        ("a = 1\n%cd /tmp", 2, "%cd /tmp"),
        ("%env CUDA_VISIBLE_DEVICES=1", 1, "%env CUDA_VISIBLE_DEVICES=1"),
        ("%run other.py", 1, "%run other.py"),
        ("if True:\n    %store x", 2, "%store x"),
    ],
)
def test_semantic_magics_are_rejected_naming_cell_and_line(source, line, text):
    with pytest.raises(CellError) as info:
        export_cell(cell(source, number=7), "ddp", "nb.ipynb")
    message = str(info.value)
    assert f"nb.ipynb: cell 7, line {line}:" in message
    assert text in message
    assert "move it to an untagged cell" in message


def test_unknown_cell_magic_is_rejected():
    with pytest.raises(CellError, match=r"cell 3, line 1: the cell magic %%capture can't be exported"):
        export_cell(cell("%%capture\nx = 1"), "ddp", "nb.ipynb")


def test_syntax_error_names_notebook_cell_line_and_text(notebook):
    path = notebook([md("intro"), code("import torch", "ddp"), code("#| ddp-train\nfor i in range(3):\n    x = (i +\n"), code("x")])
    with pytest.raises(CellError) as info:
        select_cells(read_notebook(path))
    message = str(info.value)
    assert str(path) in message and "cell 3, line 3" in message
    assert "SyntaxError" in message and "x = (i +" in message


def test_syntax_error_line_counts_from_the_magic_line():
    with pytest.raises(CellError, match=r"cell 3, line 3: SyntaxError"):
        export_cell(cell("%%ddp_train\nok = 1\nbad = = 2"), "ddp-train", "nb.ipynb")
