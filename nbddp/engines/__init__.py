"""Engines: what each adds to the generated script and how its script is launched.

``torch``: plain PyTorch DDP, one process per device started by
``torch.distributed.run``. ``catalyst``: the user's ``runner.train(...)`` runs
with Catalyst's ``DistributedDataParallelEngine``, which spawns the processes
itself. Nothing here imports torch or catalyst: this runs in the notebook
kernel and the CLI, before any rank exists.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Sequence

from nbddp.notebook.cells import TRAIN, ExportedCell
from nbddp.errors import NbddpError

ENGINES = ("torch", "catalyst")
#: Why ``--shard`` and Catalyst don't go together.
SHARD_NEEDS_TORCH = ("--shard needs the torch engine: Catalyst 22.4, its last release, has no FSDP2 engine. Drop "
                     "--shard, or train with nbddp.prepare(model) in a plain PyTorch loop (--engine torch).")


@dataclass(frozen=True)
class EngineCode:
    """Lines an engine puts around the user's cells."""

    imports: tuple[str, ...]
    """Module level, before the first cell: runs in every rank (and every spawned child)."""
    train_prologue: tuple[str, ...]
    """First lines under the ``__main__`` guard."""
    train_epilogue: tuple[str, ...]
    """Last lines under the guard: hand the returned variables back."""
    launch_hint: str
    """The command that launches the script by hand, for its header."""
    notes: tuple[str, ...] = ()
    """More header lines: what a user running it by hand must know."""


def detect_engine(cells: Sequence[ExportedCell]) -> str:
    """``catalyst`` when the training cells call a Catalyst runner's ``train(loaders=...)``.

    Catalyst's ``Runner.train`` is keyword-only and ``loaders`` is required, so
    a ``.train(..., loaders=...)`` call in code that imports catalyst is one.
    """
    imports_catalyst = any(_imports_catalyst(c.code) for c in cells)
    calls_train = any(_calls_runner_train(c.code) for c in cells if c.role == TRAIN)
    return "catalyst" if imports_catalyst and calls_train else "torch"


def engine_code(engine: str, returns: Sequence[str], script_name: str, shard: bool = False) -> EngineCode:
    """``shard``: every ``nbddp.prepare(model)`` shards with FSDP2 (the torch engine; Catalyst has no FSDP2 engine).

    Raises:
        UsageError: ``shard`` with the Catalyst engine.
    """
    if engine == "torch":
        from nbddp.engines.torch import code

        return code(tuple(returns), script_name, shard)
    if engine == "catalyst":
        if shard:
            from nbddp.errors import UsageError

            raise UsageError(SHARD_NEEDS_TORCH)
        from nbddp.engines.catalyst import code

        return code(tuple(returns), script_name)
    raise NbddpError(f"unknown engine {engine!r}; choose one of: {', '.join(ENGINES)}.")


def _parse(code: str) -> ast.AST | None:
    try:
        return ast.parse(code)
    except SyntaxError:
        return None


def _imports_catalyst(code: str) -> bool:
    tree = _parse(code)
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "catalyst" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "catalyst":
            return True
    return False


def _calls_runner_train(code: str) -> bool:
    tree = _parse(code)
    for node in ast.walk(tree) if tree else ():
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "train"
            and any(k.arg == "loaders" for k in node.keywords)
        ):
            return True
    return False
