"""One cell as the script holds it: its role, and its code with the IPython syntax translated.

A code cell's role is its mark, decided once when the notebook is read (:attr:`nbddp.notebook.reader.Cell.role`:
a tag or, equally, a first-line directive such as ``#| ddp``); in a notebook with no cell marked, it is
:mod:`nbddp.notebook.unmarked`'s choice. IPython-only syntax is
found with IPython's own input transformers (the ones the kernel runs), so
nbddp agrees with the kernel on what is a magic and what is Python; each use is
then either dropped with a note (it has no meaning in a script), translated
(``%time stmt`` runs ``stmt``), or rejected before anything runs.

Which cells a script is made of is :mod:`nbddp.notebook.cells`' (marked, or chosen by
:mod:`nbddp.notebook.unmarked`); both build on this module, as the engines' detection does.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from nbddp.contracts.errors import CellError, CellSyntaxError
from nbddp.notebook.reader import Cell, Notebook
from nbddp.contracts.role_names import INJECTED, PARAMETERS, SETUP, TRAIN, TRAIN_MAGIC  # noqa: F401 - handed on

#: Line magics that mean nothing in a training script: commented out with a note.
_INERT_MAGICS = frozenset(
    "matplotlib load_ext reload_ext unload_ext autoreload aimport config pip conda mamba "
    "who whos who_ls lsmagic magic pinfo pinfo2 psearch pdoc pdef psource pfile timeit "
    "xmode precision pprint colors page pwd history pdb doctest_mode automagic autocall "
    "autoindent alias_magic notebook ls".split()
)
#: Magics that run their argument as Python: the argument is kept, the magic dropped.
_TRANSPARENT_MAGICS = frozenset({"time"})
#: Cell magics that only time or capture the display of their body.
_TRANSPARENT_CELL_MAGICS = frozenset({"time"})


@dataclass(frozen=True)
class ExportedCell:
    """A cell chosen for the script, with its code ready to paste."""

    cell: Cell
    role: str
    code: str
    """Script code; exactly one line per cell line from ``first_line`` on."""
    first_line: int = 1
    """Cell line (1-based) that ``code``'s first line comes from (2 after ``%%ddp_train``)."""
    magic_args: str | None = None
    """Arguments of a ``%%ddp_train`` line, when the cell is one."""


@dataclass(frozen=True)
class Selection:
    """The cells a notebook's script is made of, and how they were chosen."""

    cells: tuple[ExportedCell, ...]
    """In notebook order."""
    note: str | None = None
    """Set when no cell is marked and nbddp chose them (:mod:`nbddp.notebook.unmarked`): the one line
    saying which, for a run's start (``nbddp: no cell is marked: cell 7 (trainer.fit) is …``) and the
    script's header."""


class Exports:
    """A notebook's code cells, each exported on demand and at most once (:func:`export_cell`): as its mark's role,
    setup where it has none; or the :class:`~nbddp.contracts.errors.CellError` saying why it can't be. Which cells
    are chosen asks it (:mod:`nbddp.notebook.cells`, :mod:`nbddp.notebook.unmarked`): a cell is read once, and a
    kernel-only cell of a marked notebook never."""

    def __init__(self, notebook: Notebook) -> None:
        self.notebook = notebook
        self._done: dict[int, ExportedCell | CellError] = {}

    def __getitem__(self, cell: Cell) -> ExportedCell | CellError:
        if cell.number not in self._done:
            try:
                self._done[cell.number] = export_cell(cell, cell.role or SETUP, self.notebook.path)
            except CellError as error:
                self._done[cell.number] = error
        return self._done[cell.number]


def export_cell(cell: Cell, role: str, notebook_path: Path | str) -> ExportedCell:
    """Translate one cell's IPython syntax and check that the result compiles."""
    lines = cell.source.split("\n")
    first_line, magic_args = 1, None
    head = _first_code_line(lines)
    if head is not None and lines[head].lstrip().startswith("%%"):
        name, _, args = lines[head].strip()[2:].partition(" ")
        if name == TRAIN_MAGIC:
            first_line, magic_args = head + 2, args.strip()
            lines = lines[head + 1 :]
        elif name in _TRANSPARENT_CELL_MAGICS:
            lines = list(lines)
            lines[head] = f"# {lines[head]}  # nbddp: %%{name} dropped (no meaning in a script)"
        else:
            raise _cell_error(
                notebook_path, cell, head + 1, lines[head],
                f"the cell magic %%{name} can't be exported to a script. Remove it, or move "
                "this code out of the ddp cells",
            )
    code_lines = _translate_ipython(lines, cell, first_line, notebook_path)
    code = "\n".join(code_lines)
    _check_syntax(code, cell, first_line, notebook_path)
    return ExportedCell(cell, role, code, first_line, magic_args)


def _first_code_line(lines: list[str]) -> int | None:
    for i, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#"):
            return i
    return None


def _translate_ipython(
    lines: list[str], cell: Cell, first_line: int, notebook_path: Path | str
) -> list[str]:
    """Replace each piece of IPython syntax with script code of the same line count."""
    if not any(mark in line for line in lines for mark in "%!?"):
        return lines  # IPython syntax needs one of these: skip importing IPython (~0.3 s)
    from IPython.core.inputtransformer2 import TokenTransformBase, TransformerManager, make_tokens_by_line

    manager = TransformerManager()
    source = "\n".join(lines)
    if manager.transform_cell(source).rstrip("\n") == source.rstrip("\n"):
        return lines  # plain Python: the common case, and the fast one
    out = list(lines)
    # `current` is what IPython's transformers see; `origin[i]` is the original line of current[i].
    current = [line + "\n" for line in lines]
    origin = list(range(len(lines)))
    while True:
        tokens = make_tokens_by_line(current)
        found = [t for cls in manager.token_transformers if (t := cls.find(tokens))]
        if not found:
            return out
        transformer = min(found, key=TokenTransformBase.sortby)
        try:
            new = transformer.transform(current)
        except SyntaxError:
            return out  # IPython leaves it alone too; compile() will report it
        start = transformer.start_line
        consumed = len(current) - len(new) + 1
        span = origin[start : start + consumed]
        replacement = _replace_ipython(new[start].strip(), [lines[i] for i in span])
        if replacement is None:
            number = span[0] + first_line
            raise _cell_error(
                notebook_path, cell, number, lines[span[0]],
                "this IPython syntax changes what the code does and can't be exported to a "
                "script. Rewrite it in Python (e.g. os.chdir, os.environ, subprocess.run), or "
                "move it to an untagged cell that runs only in the notebook",
            )
        for i, text in zip(span, replacement):
            out[i] = text
        current = new
        origin = origin[:start] + [span[0]] + origin[start + consumed :]


def _replace_ipython(transformed: str, original: list[str]) -> list[str] | None:
    """Script lines for one IPython construct, or ``None`` when it must be rejected.

    ``transformed`` is IPython's translation, e.g. ``get_ipython().run_line_magic('time', 'x = 1')``.
    """
    try:
        node = ast.parse(transformed).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.Expr) or not isinstance(node.value, ast.Call):
        return None  # `x = %pwd`, `files = !ls`: the value is used
    call = node.value
    method = getattr(call.func, "attr", None)
    args = [a.value for a in call.args if isinstance(a, ast.Constant)]
    indent = original[0][: len(original[0]) - len(original[0].lstrip())]
    if method == "system":
        note = "shell command not run by the ranks (it runs only in the notebook)"
        return _commented(original, indent, note)
    if method != "run_line_magic" or not args:
        return None
    name = args[0]
    if name in _INERT_MAGICS:
        return _commented(original, indent, f"%{name} has no meaning in a script")
    if name in _TRANSPARENT_MAGICS and len(original) == 1 and len(args) == 2:
        return [f"{indent}{args[1]}  # nbddp: %{name} dropped"]
    return None


def _commented(original: list[str], indent: str, note: str) -> list[str]:
    lines = [f"{indent}# {line.lstrip()}" for line in original]
    lines[0] += f"  # nbddp: {note}"
    return lines


def _check_syntax(code: str, cell: Cell, first_line: int, notebook_path: Path | str) -> None:
    try:
        compile(code, f"cell {cell.number}", "exec", dont_inherit=True)
    except SyntaxError as exc:
        number = (exc.lineno or 1) + first_line - 1
        text = (exc.text or "").rstrip("\n")
        error = _cell_error(notebook_path, cell, number, text, f"SyntaxError: {exc.msg}")
        raise CellSyntaxError(str(error), cell.number) from None


def _cell_error(notebook_path: Path | str, cell: Cell, line: int, text: str, what: str) -> CellError:
    """Names the cell as the user sees it: ``nb.ipynb: cell 3`` in a notebook, ``In [2]`` (its label) in a kernel."""
    where = cell.label or f"{notebook_path}: cell {cell.number}"
    return CellError(f"{where}, line {line}: {what}.\n    {text.strip()}")
