"""Read and validate a notebook: the first stage of the pipeline.

Cells are numbered from 1 in notebook order, markdown and raw cells included,
because that is what a person counts when scrolling the notebook; every later
stage (script comments, source map, error messages) uses this same number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from nbddp.errors import NotebookError

#: nbformat major versions we can read (v4 is what every current front end writes).
SUPPORTED_NBFORMAT = (4,)


@dataclass(frozen=True)
class Cell:
    """One notebook cell, as the rest of nbddp sees it."""

    number: int
    """1-based position in the notebook, all cell types counted."""
    cell_type: str
    source: str
    tags: tuple[str, ...] = ()
    cell_id: str | None = None
    label: str | None = None
    """How messages name the cell when it has no notebook position (``In [5]`` in a live kernel)."""

    @property
    def name(self) -> str:
        return self.label or f"cell {self.number}"


@dataclass(frozen=True)
class Notebook:
    """A validated notebook: its path (for messages), kernel language and cells."""

    path: Path
    cells: tuple[Cell, ...]
    kernel_name: str | None = None
    nb: object = field(default=None, repr=False, compare=False)
    """The nbformat node, kept for stages that execute or rewrite the notebook."""

    @property
    def code_cells(self) -> tuple[Cell, ...]:
        return tuple(c for c in self.cells if c.cell_type == "code")


def read_notebook(path: str | Path) -> Notebook:
    """Read ``path`` with nbformat and validate it.

    Raises:
        NotebookError: the file is missing, is not JSON, is not a notebook, or
            uses an nbformat version we can't read. Nothing has been written.
    """
    import nbformat  # deferred: keeps `import nbddp` light

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NotebookError(f"{path}: no such notebook. Check the path.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise NotebookError(f"{path}: cannot read the notebook ({exc}).") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotebookError(
            f"{path}: not valid notebook JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}). Open it in Jupyter and save it again, or restore it from version control."
        ) from None
    if not isinstance(raw, dict) or "cells" not in raw and "worksheets" not in raw:
        raise NotebookError(f"{path}: this JSON file is not a Jupyter notebook (no 'cells').")
    version = raw.get("nbformat")
    if version not in SUPPORTED_NBFORMAT:
        raise NotebookError(
            f"{path}: nbformat version {version!r} is not supported (nbddp reads version 4). "
            "Open and save it in a current Jupyter to upgrade it."
        )
    try:
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
    except nbformat.ValidationError as exc:
        raise NotebookError(f"{path}: invalid notebook: {exc.message}.") from None
    return from_nbformat(nb, path)


def from_nbformat(nb, path: str | Path) -> Notebook:
    """Wrap an already-loaded nbformat v4 node (used by the nbconvert exporter)."""
    cells = tuple(
        Cell(
            number=i,
            cell_type=c.get("cell_type", "code"),
            source=c.get("source", ""),
            tags=tuple(c.get("metadata", {}).get("tags", ()) or ()),
            cell_id=c.get("id"),
        )
        for i, c in enumerate(nb.cells, start=1)
    )
    kernel = nb.get("metadata", {}).get("kernelspec", {}).get("name")
    return Notebook(path=Path(path), cells=cells, kernel_name=kernel, nb=nb)
