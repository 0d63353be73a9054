"""Generate the training script (and its source map) from the selected cells.

The script reads like one a careful person writes by hand: a header saying
where it came from and how to launch it, each cell under a comment naming its
number and role, setup at module level (it runs in every rank) and the
training cells under ``if __name__ == '__main__':``. Cell lines are copied one
for one, so the source map is a list of contiguous segments.
"""

from __future__ import annotations

import io
import re
import shlex
import tokenize
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from nbddp._version import __version__
from nbddp.notebook.cells import select_cells, selection
from nbddp.notebook.roles import INJECTED, PARAMETERS, TRAIN, ExportedCell
from nbddp.engines import DEFAULT_RETURNS, ENGINES, detect_engine, plan_engine
from nbddp.contracts.errors import NbddpError
from nbddp.notebook.reader import Notebook
from nbddp.notebook.parameters import apply_overrides
from nbddp.notebook.literals import assignments, check_name
from nbddp.contracts.freevars import check_defined
from nbddp.contracts.sourcemap import Segment, SourceMap
from nbddp.contracts.rundir import SCRIPT_NAME

INDENT = "    "


@dataclass(frozen=True)
class ExportOptions:
    """What the user chose: built once from argv or magic arguments."""

    engine: str | None = None
    """An engine of :data:`nbddp.engines.ENGINES`, or ``None`` to detect it from the training cells."""
    parameters: dict[str, Any] = field(default_factory=dict)
    returns: tuple[str, ...] = DEFAULT_RETURNS
    """The variables rank 0 saves for the kernel; ``()``: none (``%%ddp_exec``; ``--return`` takes one at least)."""
    shard: bool = False
    """Every ``nbddp.prepare(model)`` shards with FSDP2 (``--shard``); the torch engine only."""
    train_cell: int | None = None
    """With no cell marked, the training cell (``--train-cell``); ``None``: the one that launches a training."""
    keep_markdown: bool = False
    script_name: str = SCRIPT_NAME
    parameters_source: str = "the command line (nbddp -p)"
    """Said in the comment above the injected parameters."""
    launch_hint: str | None = None
    """The header's launch command, when not the engine's one-machine default (several nodes, Slurm)."""
    script_dir: Path | None = None
    """Where the script will be written, so the header names the notebook by a path that works from
    there (``None``: the notebook's absolute path)."""

    def __post_init__(self) -> None:
        if self.engine is not None and self.engine not in ENGINES:
            raise NbddpError(f"unknown engine {self.engine!r}; choose one of: {', '.join(ENGINES)}.")
        for name in (*self.parameters, *self.returns):
            check_name(name)


@dataclass(frozen=True)
class Script:
    text: str
    source_map: SourceMap
    engine: str
    cells: tuple[ExportedCell, ...]
    processes: int | None = None
    """The process count the cells ask their library for (``notebook_launcher(num_processes=N)``,
    ``Trainer(devices=N)``): the run's unless a launch option says otherwise."""
    saves_checkpoints: bool = False
    """The cells call ``nbddp.save_checkpoint``: a Slurm job requeues itself by default."""
    note: str | None = None
    """No cell is marked: which cells nbddp chose (:attr:`nbddp.notebook.cells.Selection.note`), said
    when a run starts and written in the header."""
    returns: tuple[str, ...] = DEFAULT_RETURNS
    """The variables rank 0 saves for the kernel; ``()`` when no cell defines the default ``model``."""
    returns_note: str = ""
    """Why nothing comes back, when :attr:`returns` is empty (for the kernel and the ending)."""
    notices: tuple[str, ...] = ()
    """What the user must hear before anything runs (a ``-p`` value whose type differs from its default):
    said by every door that runs or writes the script."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """Every parameter value the run uses: the parameters cells' defaults (papermill's injected cell's after
    them), then the overrides (``-p``) over them, as ``result.json`` records them."""

    @property
    def training(self) -> tuple[int, ...]:
        """The numbers of the notebook's training cells, which the kernel beside the job receives from it."""
        return tuple(c.cell.number for c in self.cells if c.role == TRAIN)


def generate(notebook: Notebook, options: ExportOptions = ExportOptions(), *, to_run: bool = False) -> Script:
    """Notebook → script text + source map. ``to_run``: the script is about to run, so a name its running code
    reads that nothing defines is refused now (:func:`~nbddp.contracts.freevars.check_defined`), not met as a
    NameError in every rank; an export is written all the same (the user may be about to edit it).

    Raises:
        NotebookError, CellError: bad input. ParameterError: an override the parameters cell
            doesn't declare.
    """
    chosen = selection(notebook, options.returns, options.train_cell)  # a cell that isn't valid Python: reported first
    applied = apply_overrides(notebook, options.parameters)
    markdown = _markdown_before(notebook) if options.keep_markdown else {}
    script = replace(render(chosen.cells, notebook.path, options, markdown, chosen.note), notices=applied.notices,
                     parameters=applied.values)
    if to_run:
        check_defined(script)
    return script


def engine_of(notebook: Notebook, engine: str | None = None, train_cell: int | None = None) -> str:
    """The engine the notebook's script runs on: ``engine`` if given, else the one its training cells (with no cell
    marked, cell ``train_cell`` if given) call for."""
    return engine or detect_engine(select_cells(notebook, train_cell=train_cell))


def render(cells: Sequence[ExportedCell], source: Path | str, options: ExportOptions,
           markdown: dict[int, tuple[str, ...]] | None = None, note: str | None = None) -> Script:
    """Exported cells → script text + source map; ``source`` names where they came from, ``note`` how
    they were chosen when no cell was marked."""
    source = Path(source)
    markdown = markdown or {}
    planned = plan_engine(cells, options.engine, options.returns, options.script_name, options.shard)
    engine, engine_lines, returns, returns_note = planned.engine, planned.code, planned.returns, planned.returns_note
    writer = _Writer()
    if any(c.cell.label for c in cells):
        numbers = ", ".join(c.cell.name for c in cells)
    else:
        numbers = "cells " + ", ".join(str(c.cell.number) for c in cells)
    writer.comment_block(
        [
            f"Generated by nbddp {__version__} from {source.name} ({numbers}); engine: {engine}.",
            *([f"{note[:1].upper()}{note[1:]} (nbddp's choice: mark cells '#| ddp-train' / '#| ddp' to choose "
               "otherwise)."] if note else []),
            "Edit the notebook, not this file: `nbddp export` writes it again.",
            f"Launch: {engine_lines.launch_hint if options.launch_hint is None else options.launch_hint}",
            *([f"    or: nbddp run {_notebook_ref(source, options.script_dir)}{' --shard' if options.shard else ''}   "
               f"(the whole notebook, training {'sharded' if options.shard else 'as DDP'})"]
              if source.suffix == ".ipynb" else []),  # (not from a kernel's cells: there is no notebook file)
            (f"Weights: rank 0 saves {', '.join(returns)} to {Path(options.script_name).stem}.weights.pt "
             "beside this script (weights.pt in the run dir under nbddp)." if returns else
             f"Weights: {returns_note[:1].upper()}{returns_note[1:]}." if returns_note else "Weights: none come back."),
            *engine_lines.notes,
        ]
    )
    writer.blank()
    for line in engine_lines.imports:
        writer.line(line)
    setup = [c for c in cells if c.role != TRAIN]
    training = [c for c in cells if c.role == TRAIN]
    injected_done = not options.parameters
    if not injected_done and not any(c.role in (PARAMETERS, INJECTED) for c in setup):
        writer.parameters(options.parameters, options.parameters_source)  # no parameters cell: first
        injected_done = True
    for cell in setup:
        writer.cell(cell, markdown.get(cell.cell.number, ()))
        if not injected_done and _is_last_parameters_cell(cell, setup):
            writer.parameters(options.parameters, options.parameters_source)
            injected_done = True
    if not injected_done:
        writer.parameters(options.parameters, options.parameters_source)
    writer.blank()
    writer.blank()
    writer.line("if __name__ == '__main__':")
    for line in engine_lines.train_prologue:
        writer.line(INDENT + line)
    for cell in training:
        writer.cell(cell, markdown.get(cell.cell.number, ()), indent=INDENT)
    writer.blank()
    for line in engine_lines.train_epilogue:
        writer.line(INDENT + line)
    source_map = SourceMap(str(source), options.script_name, tuple(writer.segments))
    return Script(writer.text(), source_map, engine, tuple(cells), planned.processes, planned.saves_checkpoints, note,
                  returns, returns_note)


def _notebook_ref(notebook: Path, script_dir: Path | None) -> str:
    """The notebook's path as seen from the script's folder (absolute when that folder is unknown), as a shell word:
    the header's ``nbddp run PATH`` can be pasted into a shell whatever the path holds."""
    import os

    if script_dir is None:
        return shlex.quote(str(notebook.resolve()))
    return shlex.quote(os.path.relpath(notebook.resolve(), Path(script_dir).resolve()))


#: What must not reach a comment as itself: C0 and C1 controls but the tab (a line feed or carriage return ends a
#: comment, and the rest of the line would be code), the line and paragraph separators (editors and
#: ``str.splitlines`` show a new line there) and the bidirectional controls (they reorder what an editor shows:
#: "Trojan Source").
_NOT_COMMENT_TEXT = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def as_comment(text: str) -> str:
    """``text`` as the body of one comment line: each character of :data:`_NOT_COMMENT_TEXT` written as its escape
    (``\\n``, ``\\r``, ``\\u2028``), so that a notebook's name, a path or a markdown line is read as it is and never
    ends the comment to become code."""
    return _NOT_COMMENT_TEXT.sub(lambda found: found.group().encode("unicode_escape").decode("ascii"), text)


def write_script(script: Script, path: str | Path) -> tuple[Path, Path]:
    """Write the script and its source map beside it; returns both paths."""
    from nbddp.contracts.sourcemap import sourcemap_path

    path = Path(path)
    map_path = sourcemap_path(path)
    for target, text in ((path, script.text), (map_path, script.source_map.to_json())):
        target.write_text(text, encoding="utf-8")
        target.chmod(0o644)  # readable, never world- or group-writable, whatever the umask
    return path, map_path


def _is_last_parameters_cell(cell: ExportedCell, setup: Sequence[ExportedCell]) -> bool:
    """Command-line parameters go after papermill's cells, so they win, as in papermill."""
    if cell.role not in (PARAMETERS, INJECTED):
        return False
    later = setup[setup.index(cell) + 1 :]
    return not any(c.role in (PARAMETERS, INJECTED) for c in later)


def _markdown_before(notebook: Notebook) -> dict[int, tuple[str, ...]]:
    """Markdown cells preceding each code cell, for ``keep_markdown``."""
    pending: list[str] = []
    result: dict[int, tuple[str, ...]] = {}
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            pending.extend(cell.source.split("\n"))
        elif cell.cell_type == "code":
            result[cell.number] = tuple(pending)
            pending = []
    return result


class _Writer:
    """Accumulates script lines and the source map segments that describe them."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.segments: list[Segment] = []

    def line(self, text: str) -> None:
        self.lines.append(text)

    def blank(self) -> None:
        self.lines.append("")

    def comment(self, text: str, indent: str = "") -> None:
        """One comment line; whatever ``text`` holds stays inside it (:func:`as_comment`)."""
        self.line(f"{indent}# {as_comment(text)}".rstrip())

    def comment_block(self, texts: Sequence[str], indent: str = "") -> None:
        for text in texts:
            self.comment(text, indent)

    def cell(self, cell: ExportedCell, markdown: Sequence[str] = (), indent: str = "") -> None:
        self.blank()
        if markdown:
            self.comment_block(markdown, indent)
        self.comment(f"%% {cell.cell.name} [{cell.role}]", indent)
        code = cell.code.rstrip()
        body = indent_code(code, indent) if indent else code.split("\n")
        if indent and not code.strip():
            body = [indent + "pass"]
        self.segments.append(Segment(len(self.lines) + 1, len(body), cell.cell.number, cell.first_line,
                                     cell.role, cell.cell.label))
        self.lines.extend(body)

    def parameters(self, parameters: dict[str, Any], source: str) -> None:
        self.blank()
        self.comment(f"%% parameters from {source}")
        self.lines.extend(assignments(parameters))

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def indent_code(code: str, indent: str) -> list[str]:
    """Indent every line except those that continue a multi-line string.

    Indenting a line inside a triple-quoted string would change the string's
    value, so those lines are found with ``tokenize`` and left untouched.
    """
    lines = code.split("\n")
    inside_string: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.start[0] != tok.end[0] and tok.type in (tokenize.STRING, _FSTRING_MIDDLE, _FSTRING_END):
                inside_string.update(range(tok.start[0] + 1, tok.end[0] + 1))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # the cell compiled, so this is only a tokenizer corner case: indent everything
    return [line if (i in inside_string or not line) else indent + line for i, line in enumerate(lines, start=1)]


_FSTRING_MIDDLE = getattr(tokenize, "FSTRING_MIDDLE", -1)
_FSTRING_END = getattr(tokenize, "FSTRING_END", -1)
