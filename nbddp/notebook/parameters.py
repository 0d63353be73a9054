"""The notebook's ``parameters`` cell: the names it declares, their defaults, and overrides checked
against them.

papermill only warns about a ``-p`` name the notebook doesn't declare; nbddp refuses it before
anything runs (for ``run``, ``export`` and ``batch`` alike), because a typo such as
``-p learning_rate 0.1`` for a notebook that reads ``lr`` would otherwise silently train with the
default and waste the run.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass
from typing import Any

from nbddp.contracts.cell_tree import tree as cell_tree
from nbddp.contracts.role_names import INJECTED, PARAMETERS
from nbddp.notebook.literals import Unquoted
from nbddp.contracts.errors import ParameterError, see
from nbddp.notebook.reader import Notebook


def declared_parameters(notebook: Notebook, roles: tuple[str, ...] = (PARAMETERS, INJECTED)) -> dict[str, Any]:
    """Name → default for every name assigned in the cells of ``roles``, in order: the ``parameters``
    cell(s) and papermill's ``injected-parameters`` cell (its values win, as in the kernel).

    A default that is a literal is its value; any other expression is kept as its source text in
    ``{"expression": "..."}`` (so ``result.json`` can say what it was without running it).
    """
    declared: dict[str, Any] = {}
    for cell in notebook.code_cells:
        if cell.role not in roles:
            continue
        try:
            tree = cell_tree(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            for name, value in _assignments(node, cell.source):
                declared[name] = value
    return declared


def _assignments(node: ast.stmt, source: str) -> list[tuple[str, Any]]:
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets, value = [node.target], node.value
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):  # `lr: float`, set by -p
        return [(node.target.id, {"annotation": ast.get_source_segment(source, node.annotation)})]
    else:
        return []
    default = _default(value, source)
    found = []
    for target in targets:
        names = [sub.id for sub in ast.walk(target) if isinstance(sub, ast.Name)]
        single = isinstance(target, ast.Name)
        found += [(name, default if single else {"expression": ast.get_source_segment(source, value)})
                  for name in names]
    return found


def _default(value: ast.expr, source: str) -> Any:
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return {"expression": ast.get_source_segment(source, value)}


@dataclass(frozen=True)
class Applied:
    """A run's overrides (``-p``), checked against the notebook's parameters cells and applied to their defaults."""

    values: dict[str, Any]
    """Every parameter value the run uses: the declared defaults, then the overrides over them."""
    notices: tuple[str, ...]
    """What the user must hear before anything runs (:func:`type_notices`)."""


def apply_overrides(notebook: Notebook, overrides: dict[str, Any]) -> Applied:
    """``overrides`` checked (:func:`check_overrides`, :func:`type_notices`) and applied to the declared defaults.

    Raises:
        ParameterError: a name the parameters cells don't declare, or text that reads as no literal.
    """
    declared = check_overrides(notebook, overrides)
    return Applied({**declared, **overrides}, type_notices(declared, overrides))


def check_overrides(notebook: Notebook, names: list[str] | set[str] | dict[str, Any],
                    roles: tuple[str, ...] = (PARAMETERS, INJECTED)) -> dict[str, Any]:
    """Refuse names the cells of ``roles`` don't declare; returns the declared defaults.

    Raises:
        ParameterError: a name not declared (the message lists the declared ones and the closest one),
            or any name at all when the notebook has no parameters cell.
    """
    declared = declared_parameters(notebook, roles)
    unknown = sorted(set(names) - set(declared))
    if not unknown:
        return declared
    plural = "s" * (len(unknown) > 1)
    if not declared:
        raise ParameterError(
            f"{notebook.path}: unknown parameter{plural} {', '.join(unknown)}: the notebook has no 'parameters' "
            "cell. Tag the cell that sets the hyperparameters 'parameters' (or start it with '#| parameters').")
    hints = [hint for name in unknown if (hint := closest_parameter(name, declared))]
    raise ParameterError(f"{notebook.path}: unknown parameter{plural} {', '.join(unknown)}; "
                         f"the parameters cell defines {', '.join(declared)}."
                         + (f" Did you mean {' / '.join(hints)}?" if hints else "") + see("unknown-parameter"))


def closest_parameter(name: str, declared: dict[str, Any] | list[str]) -> str | None:
    """The declared name ``name`` most likely meant: the same but for case, the same initials
    (``learning_rate`` for ``lr``, and back), or the closest spelling; ``None`` if none is close."""
    candidates = list(declared)
    for other in candidates:
        if other.lower() == name.lower() or _initials(other) == name.lower() or _initials(name) == other.lower():
            return other
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def _initials(name: str) -> str:
    parts = [part for part in name.lower().split("_") if part]
    return "".join(part[0] for part in parts) if len(parts) > 1 else ""


def type_notices(declared: dict[str, Any], overrides: dict[str, Any],
                 holder: str = "the notebook's") -> tuple[str, ...]:
    """One line for each override whose type differs from its literal default (``-p name 3`` for ``name = 'x'``), said
    the same way by every door before anything runs.

    A value typed as text that reads as no Python literal (:class:`~nbddp.notebook.literals.Unquoted`: ``-p lr abc``
    for ``lr = 0.05``) is refused instead: it would fail deep inside the ranks, after the launch; quoted
    (``-p lr "'abc'"``), or given as a ``str`` in Python, it is text meant, and said as any other. An int for a float
    default (``-p lr 1``) and ``None`` either way are what people mean; a default that isn't a literal has no type to
    compare with.
    ``holder``: whose the defaults are (``%%ddp_train``'s: the kernel's values).

    Raises:
        ParameterError: an unquoted text value for a default that isn't text.
    """
    notices = []
    for name, value in overrides.items():
        default = declared.get(name)
        if default is None or value is None or isinstance(default, dict) or _kind(value) == _kind(default):
            continue
        if isinstance(value, Unquoted):
            raise ParameterError(
                f"-p {name} {value}: {holder} {name} is {default!r}, {_kind(default)}, and {value!r} reads as "
                f"no Python literal (a typo?). Give {_kind(default)}, or quote the text to pass it as it is: "
                f"-p {name} \"'{value}'\"." + see("a-p-value-that-reads-as-no-python-literal"))
        notices.append(f"warning: parameter {name} = {value!r} is {_kind(value)}, but {holder} default "
                       f"{default!r} is {_kind(default)}: the cells get {value!r} as it is.")
    return tuple(notices)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, (int, float)):
        return "a number"
    return "text" if isinstance(value, str) else f"a {type(value).__name__}"

