"""A search space written on the command line (``--space "lr=loguniform(1e-4,1e-1)"``), and the names a space gives.

Each ``--space`` is ``NAME=DIST(ARGS)``, read with :mod:`ast` (never evaluated): ``uniform(low, high)`` and
``float(low, high[, step])``, ``loguniform(low, high)``, ``int(low, high[, step])``, ``logint(low, high)``,
``choice(a, b, …)`` (each a Python literal, or a bare word read as text). Each is one of Optuna's own ``suggest_*``
calls: the sampler sees the distribution Optuna would, so sampling, pruning and storage behave as Optuna documents.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from nbddp.contracts.errors import UsageError

#: What ``--space`` takes, said with each refusal.
FORMS = ("uniform(low,high)", "float(low,high[,step])", "loguniform(low,high)", "int(low,high[,step])",
         "logint(low,high)", "choice(a,b,...)")
_NAME = re.compile(r"^[A-Za-z_]\w*$")

Space = Callable[[Any], dict[str, Any]]
"""A search space: Optuna's trial → ``{name: value}`` (written with ``trial.suggest_*``)."""


@dataclass(frozen=True)
class Dimension:
    """One ``--space`` entry: ``kind`` is one of :data:`FORMS`' names, ``args`` its bounds (or choices)."""

    name: str
    kind: str
    args: tuple[Any, ...]

    def suggest(self, trial: Any) -> Any:
        """The trial's value for this dimension, asked of Optuna as the matching ``suggest_*`` call."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.name, list(self.args))
        low, high, *step = self.args
        if self.kind in ("int", "logint"):
            return trial.suggest_int(self.name, low, high, step=step[0] if step else 1, log=self.kind == "logint")
        return trial.suggest_float(self.name, low, high, step=step[0] if step else None, log=self.kind == "loguniform")


@dataclass(frozen=True)
class CommandLineSpace:
    """The space of every ``--space`` given (a :data:`Space`)."""

    dimensions: tuple[Dimension, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dimensions)

    def __call__(self, trial: Any) -> dict[str, Any]:
        return {d.name: d.suggest(trial) for d in self.dimensions}


def parse_space(specs: Sequence[str]) -> CommandLineSpace:
    """``["lr=loguniform(1e-4,1e-1)", "hidden=int(16,256)"]`` → the space.

    Raises:
        UsageError: no ``--space``, a malformed one, an unknown distribution, bounds out of order, a name given twice.
    """
    if not specs:
        raise UsageError("give the search space: --space NAME=DIST(...), once per parameter, e.g. "
                         "--space \"lr=loguniform(1e-4,1e-1)\" (DIST: " + ", ".join(FORMS) + ")")
    dimensions: list[Dimension] = []
    for spec in specs:
        dimension = _dimension(spec)
        if any(d.name == dimension.name for d in dimensions):
            raise UsageError(f"--space {spec!r}: {dimension.name} is given twice")
        dimensions.append(dimension)
    return CommandLineSpace(tuple(dimensions))


def _dimension(spec: str) -> Dimension:
    name, equals, text = spec.partition("=")
    name = name.strip()
    if not equals or not _NAME.match(name):
        raise _bad(spec, "write NAME=DIST(...), NAME a Python name")
    try:
        call = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise _bad(spec, f"{text.strip()!r} is not DIST(...)") from None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.keywords:
        raise _bad(spec, f"{text.strip()!r} is not DIST(...)")
    kind = {"categorical": "choice", "log": "loguniform"}.get(call.func.id, call.func.id)
    if kind not in ("uniform", "float", "loguniform", "int", "logint", "choice"):
        raise _bad(spec, f"unknown distribution {call.func.id!r}")
    args = tuple(_literal(arg, kind == "choice", spec) for arg in call.args)
    if kind == "choice":
        if not args:
            raise _bad(spec, "choice(...) needs at least one value")
        return Dimension(name, "choice", args)
    return Dimension(name, "float" if kind == "uniform" else kind, _bounds(kind, args, spec))


def _bounds(kind: str, args: tuple[Any, ...], spec: str) -> tuple[Any, ...]:
    most = 3 if kind in ("int", "float", "uniform") else 2
    if not 2 <= len(args) <= most or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise _bad(spec, f"{kind}(...) takes {'low, high[, step]' if most == 3 else 'low, high'}, numbers")
    if kind in ("int", "logint") and not all(isinstance(a, int) for a in args):
        raise _bad(spec, f"{kind}(...) takes whole numbers")
    low, high, *step = args
    if not low < high:
        raise _bad(spec, f"low ({low}) must be below high ({high})")
    if kind.startswith("log") and low <= 0:
        raise _bad(spec, f"a log scale starts above 0 (low is {low})")
    if step and step[0] <= 0:
        raise _bad(spec, f"step ({step[0]}) must be above 0")
    return (float(low), float(high), *map(float, step)) if kind in ("float", "uniform", "loguniform") else args


def _literal(node: ast.expr, words: bool, spec: str) -> Any:
    """A Python literal (``-1e-3``, ``'adam'``, ``None``); with ``words``, a bare word is its own text."""
    if words and isinstance(node, ast.Name):
        return node.id
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise _bad(spec, f"{ast.unparse(node)!r} is not a number or a literal") from None


def _bad(spec: str, why: str) -> UsageError:
    return UsageError(f"--space {spec!r}: {why} (DIST: {', '.join(FORMS)})")


class _Probe:
    """A stand-in trial that answers every ``suggest_*`` with its lowest choice: calling a space with it finds the
    names the space gives, before any trial starts. A space that asks anything else of its trial isn't probed."""

    number = 0
    params: dict[str, Any] = {}

    def suggest_float(self, name: str, low: float, *_: Any, **__: Any) -> float:  # (step, log: by place or name)
        return low

    def suggest_int(self, name: str, low: int, *_: Any, **__: Any) -> int:
        return low

    def suggest_categorical(self, name: str, choices: Sequence[Any], *_: Any, **__: Any) -> Any:
        return choices[0]

    suggest_uniform = suggest_loguniform = suggest_discrete_uniform = suggest_float

    def set_user_attr(self, key: str, value: Any) -> None:
        return None


def probed_names(space: Space) -> tuple[str, ...] | None:
    """The names ``space`` gives, found by calling it with a stand-in trial (``None``: it can't be probed; its
    names are then checked at its first trial). A space that returns no mapping is refused."""
    try:
        values = space(_Probe())
    except Exception:  # noqa: BLE001 - a space that needs a real trial (its own attributes, a pruner's state)
        return None
    if not isinstance(values, dict):
        raise UsageError(f"the space must return a dict of parameter values (name → value); it returned "
                         f"{type(values).__name__}")
    return tuple(values)
