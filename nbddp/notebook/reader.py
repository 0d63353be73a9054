"""Read and validate a notebook, and each code cell's mark: the first stage of the pipeline.

Cells are numbered from 1 in notebook order, markdown and raw cells included,
because that is what a person counts when scrolling the notebook; every later
stage (script comments, source map, error messages) uses this same number.

A code cell's mark (:attr:`Cell.role`) is decided here, once: its tags or, equally, a directive on its
first line (``#| ddp``), for editors without a tag UI, or a ``%%ddp_train`` first line. Every later stage
reads it from the cell (which cells the script is made of, the parameters, the kernel's injected cell).
"""

from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from nbddp.contracts.errors import CellError, NotebookError
from nbddp.contracts.role_names import DIRECTIVE_ROLES, ROLES, TRAIN, TRAIN_MAGIC

if TYPE_CHECKING:
    from nbformat import NotebookNode, ValidationError

#: nbformat major versions we can read (v4 is what every current front end writes).
SUPPORTED_NBFORMAT = (4,)

_DIRECTIVE = re.compile(r"^#\|\s*([A-Za-z][\w-]*)\s*$")


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
    role: str | None = None
    """Its mark (:func:`cell_role`), decided when the notebook is read; ``None``: unmarked."""

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
        CellError: a cell with two marks, or an unknown ``#| ddp…`` directive (:func:`from_nbformat`).
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
    except RecursionError:
        raise NotebookError(f"{path}: its JSON is nested too deeply to be a notebook (no editor writes that). "
                            "Restore it from version control.") from None
    if not isinstance(raw, dict) or "cells" not in raw and "worksheets" not in raw:
        raise NotebookError(f"{path}: this JSON file is not a Jupyter notebook (no 'cells').")
    _check_cells(path, raw.get("cells"))
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
        raise NotebookError(f"{path}: invalid notebook{_where(exc)}: {exc.message}.") from None
    except RecursionError:
        raise NotebookError(f"{path}: its JSON is nested too deeply to be a notebook (no editor writes that). "
                            "Restore it from version control.") from None
    return from_nbformat(nb, path)


def _where(error: ValidationError) -> str:
    """`` (cell 2's metadata.tags)``: where in the notebook nbformat's schema found it wrong."""
    where = list(getattr(error, "absolute_path", None) or getattr(error, "path", None) or ())
    if len(where) >= 2 and where[0] == "cells" and isinstance(where[1], int):
        rest = ".".join(str(part) for part in where[2:])
        return f" (cell {where[1] + 1}" + (f"'s {rest})" if rest else ")")
    return f" (at {'.'.join(str(part) for part in where)})" if where else ""


def _check_cells(path: Path, cells: object) -> None:
    """What nbformat assumes before it validates anything (it joins a cell's ``source`` lines first): each cell
    an object, its source text or a list of text lines. Anything else is named by its cell, not a
    ``TypeError`` from inside nbformat."""
    if not isinstance(cells, list):
        raise NotebookError(f"{path}: 'cells' is a {type(cells).__name__}, not a list of cells. Restore the "
                            "notebook from version control.")
    for number, cell in enumerate(cells, start=1):
        if not isinstance(cell, dict):
            raise NotebookError(f"{path}: cell {number} is {reprlib.repr(cell)}, not a cell. Restore the notebook "
                                "from version control.")
        source = cell.get("source", "")
        lines = source if isinstance(source, list) else [source]
        wrong = next((line for line in lines if not isinstance(line, str)), None)
        if wrong is not None:
            raise NotebookError(f"{path}: cell {number}'s source holds {reprlib.repr(wrong)} "
                                f"({type(wrong).__name__}), not text. "
                                "Open the notebook in Jupyter and fix that cell, or restore it from version control.")


def from_nbformat(nb: NotebookNode, path: str | Path) -> Notebook:
    """Wrap an already-loaded nbformat v4 node (papermill's and nbconvert's doors have one), each code cell's
    mark decided.

    Raises:
        CellError: a cell with two marks, or an unknown ``#| ddp…`` directive (a typo would leave it unmarked).
    """
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
    cells = tuple(replace(cell, role=cell_role(cell, path)) if cell.cell_type == "code" else cell for cell in cells)
    kernel = nb.get("metadata", {}).get("kernelspec", {}).get("name")
    return Notebook(path=Path(path), cells=cells, kernel_name=kernel, nb=nb)


def cell_role(cell: Cell, notebook_path: Path | str = "notebook") -> str | None:
    """The cell's role from its tags or first-line directive; ``None`` if untagged."""
    if cell.cell_type != "code":
        return None
    roles = [t for t in cell.tags if t in ROLES]
    first = cell.source.lstrip("\n").split("\n", 1)[0].strip()
    word = directive(cell.source)
    if word in DIRECTIVE_ROLES:
        roles.append(word)
    elif word is not None and (word.startswith("ddp") or word.startswith("param")):
        raise CellError(
            f"{notebook_path}: cell {cell.number}, line 1: unknown directive {first!r}. "
            f"Use one of: {', '.join('#| ' + r for r in DIRECTIVE_ROLES)}."
        )
    if first.startswith("%%" + TRAIN_MAGIC) and first[2:].split()[0] == TRAIN_MAGIC:
        roles.append(TRAIN)
    distinct = sorted(set(roles), key=ROLES.index)
    if len(distinct) > 1:
        raise CellError(
            f"{notebook_path}: cell {cell.number} has conflicting roles {distinct}. "
            "Give it one of the tags/directives, or split it into two cells."
        )
    return distinct[0] if distinct else None


def directive(source: str) -> str | None:
    """The word of a cell's first-line ``#| word`` directive (any word), or ``None``."""
    match = _DIRECTIVE.match(source.lstrip("\n").split("\n", 1)[0].strip())
    return match.group(1) if match else None
