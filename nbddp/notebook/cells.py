"""Which cells a notebook's script is made of: the marked ones (tags, ``#|`` directives, ``%%ddp_train``),
or, where no cell is marked, those nbddp chooses (:mod:`nbddp.notebook.unmarked`).

A cell's mark is read with the notebook (:attr:`nbddp.notebook.reader.Cell.role`), its exported code is
:mod:`nbddp.notebook.roles`'; their names are imported here too, where the callers of this module have always
found them.
"""

from __future__ import annotations

from typing import Sequence

from nbddp.contracts.errors import CellError, NotebookError
from nbddp.notebook.reader import Notebook, cell_role, directive  # noqa: F401 - handed on (see above)
from nbddp.notebook.roles import (INJECTED, PARAMETERS, SETUP, TRAIN, TRAIN_MAGIC,  # noqa: F401 - handed on (see above)
                                  ExportedCell, Exports, Selection, export_cell)
from nbddp.notebook.unmarked import choose, launching_cell, no_training_cell


def select_cells(notebook: Notebook, returns: Sequence[str] = (), train_cell: int | None = None) -> list[ExportedCell]:
    """The cells to export, in notebook order, with their IPython syntax translated (:func:`selection`)."""
    return list(selection(notebook, returns, train_cell).cells)


def selection(notebook: Notebook, returns: Sequence[str] = (), train_cell: int | None = None) -> Selection:
    """The cells to export: the marked ones (tags, ``#|`` directives, ``%%ddp_train``) or, where no cell is
    marked but a parameters cell, those nbddp chooses (the cell that launches a library's training, or cell
    ``train_cell`` (``--train-cell``), and the earlier cells it needs: :mod:`nbddp.notebook.unmarked`).
    ``returns``: the variables the run hands back, which the chosen cells must define.

    Raises:
        NotebookError: no training cell (saying what to mark), no safe choice of an unmarked one's setup, or
            ``train_cell`` for a notebook whose cells are marked.
        CellError: a syntax error, or IPython syntax that can't be exported.
    """
    exports = Exports(notebook)
    marked = [cell.number for cell in notebook.code_cells if cell.role in (SETUP, TRAIN)]
    if not marked:
        return choose(notebook, exports, returns, train_cell)
    if train_cell is not None:
        raise NotebookError(f"{notebook.path}: --train-cell {train_cell} names the training cell of a notebook with no "
                            f"cell marked, but cell{'s' * (len(marked) > 1)} {', '.join(map(str, marked))} "
                            f"{'are' if len(marked) > 1 else 'is'} marked: the marks say which cells train. Drop "
                            "--train-cell, or the marks.")
    exported = [exports[cell] for cell in notebook.code_cells if cell.role is not None]
    if (error := next((e for e in exported if isinstance(e, CellError)), None)) is not None:
        raise error
    if not any(e.role == TRAIN for e in exported):
        raise NotebookError(no_training_cell(notebook))
    return Selection(tuple(exported))


def training_cells(notebook: Notebook, train_cell: int | None = None) -> tuple[int, ...]:
    """The numbers of the cells that train, marked or (no cell marked) chosen (``train_cell``, if given, else the
    first that launches a training: :func:`selection` refuses several); ``()`` for none. Cheaper than
    :func:`selection`: the setup isn't chosen (papermill's engine asks it of every notebook)."""
    if any(cell.role in (SETUP, TRAIN) for cell in notebook.code_cells):
        return tuple(cell.number for cell in notebook.code_cells if cell.role == TRAIN)
    if train_cell is not None:
        return (train_cell,)
    found = launching_cell(notebook)
    return () if found is None else (found[0].number,)
