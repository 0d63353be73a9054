"""A job's script as a warm rank runs it: unit after unit, each setup cell compiled alone.

:mod:`nbddp.notebook.script` writes the setup at module level, one ``# %% cell N`` after the other (its
source map says which lines are which cell's), and the training under ``if __name__ == '__main__':``.
:func:`units_of` cuts it into :class:`Unit` s, each compiled with the script's own line numbers (so a
traceback reads as a fresh rank's): a setup cell is a ``cell`` unit; nbddp's own lines (the engine's
imports, ``_nbddp.start()``, the parameters it writes) and a parameters cell made of literals are
``literal`` units, cheap to run on every job, whose values the cells that read them depend on; the
training is the last unit. :mod:`nbddp.rank_side.warm.state` decides which of them run.
"""

from __future__ import annotations

import ast
import hashlib
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbddp.contracts.role_names import INJECTED, PARAMETERS
from nbddp.contracts.freevars import global_reads
from nbddp.contracts.sourcemap import Segment, SourceMap, sourcemap_path

CELL, LITERAL, TRAIN = "cell", "literal", "train"


@dataclass(frozen=True)
class Unit:
    """Consecutive top-level statements of the script that run together."""

    kind: str
    code: types.CodeType
    text: str
    first_line: int
    length: int
    name: str = ""
    """The cell's name for the user (``cell 3``, ``In [5]``); empty for nbddp's own lines."""
    number: int | None = None
    reads: frozenset[str] = frozenset()
    imports: tuple[tuple[str, str], ...] = ()
    """The names its ``import`` statements bind, and the module each comes from."""



def units_of(script: Path) -> list[Unit] | None:
    """The script's units in order, the training last; ``None`` for a script not shaped as nbddp writes them."""
    text = Path(script).read_text(encoding="utf-8")
    try:
        tree = ast.parse(text, str(script))
        segments = SourceMap.load(sourcemap_path(script)).segments
    except (OSError, ValueError, KeyError, TypeError, SyntaxError):
        return None
    body = tree.body
    if not body or not _is_main_guard(body[-1]):
        return None
    lines = text.split("\n")
    groups: list[tuple[Segment | None, list[ast.stmt]]] = []
    for statement in body[:-1]:
        segment = next((s for s in segments if s.cell is not None
                        and s.script_start <= statement.lineno < s.script_start + s.length), None)
        if groups and groups[-1][0] is segment:
            groups[-1][1].append(statement)
        else:
            groups.append((segment, [statement]))
    units = [_unit(segment, statements, lines, script) for segment, statements in groups]
    train = body[-1]
    units.append(Unit(TRAIN, _compile([train], script), "", train.lineno, train.end_lineno - train.lineno + 1))
    return units


def _unit(segment: Segment | None, statements: list[ast.stmt], lines: list[str], script: Path) -> Unit:
    code = _compile(statements, script)
    if segment is None:  # nbddp's own lines
        first, last = statements[0].lineno, statements[-1].end_lineno
        return Unit(LITERAL, code, "\n".join(lines[first - 1:last]), first, last - first + 1)
    source = "\n".join(lines[segment.script_start - 1:segment.script_start - 1 + segment.length])
    literal = segment.role in (PARAMETERS, INJECTED) and all(map(_literal, statements))
    name = segment.label or f"cell {segment.cell}"
    return Unit(LITERAL if literal else CELL, code, source, segment.script_start, segment.length, name, segment.cell,
                frozenset(global_reads(source)) if not literal else frozenset(), _imports(statements))


def _imports(statements: list[ast.stmt]) -> tuple[tuple[str, str], ...]:
    found = []
    for node in (n for statement in statements for n in ast.walk(statement)):
        if isinstance(node, ast.Import):
            found += [((a.asname or a.name).split(".")[0], a.name if a.asname else a.name.split(".")[0])
                      for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(a.asname or a.name, node.module) for a in node.names if a.name != "*"]
    return tuple(found)


def _compile(statements: list[ast.stmt], script: Path) -> types.CodeType:
    return compile(ast.Module(body=statements, type_ignores=[]), str(script), "exec")


def _is_main_guard(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__")


def _literal(statement: ast.stmt) -> bool:
    """``name = <literal>`` (or a bare string): a value nothing can change but the cell's text."""
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
        return True
    if isinstance(statement, ast.Assign) and all(isinstance(t, ast.Name) for t in statement.targets):
        value = statement.value
    elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.value:
        value = statement.value
    else:
        return False
    try:
        ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def digest(value: Any) -> str:
    """What a literal value is, for comparing runs (a module by its name)."""
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    try:
        return hashlib.sha256(repr(value).encode()).hexdigest()[:24]
    except Exception:  # noqa: BLE001 - a value with no repr changes every time
        return f"id {id(value)}"


def file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:24]
    except OSError:
        return "missing"
