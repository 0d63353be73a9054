"""The catalyst engine: the user's ``runner.train(...)`` under Catalyst's DDP engine.

The user's call stays as they wrote it: the script asks the nbddp runtime to
give every Catalyst ``Runner.train`` a ``DistributedDataParallelEngine`` built
for the requested devices (on CPU ``cpu=True`` and the gloo backend, without
which both ranks believe they are the main process) and a free port instead of
Catalyst's fixed 2112. Catalyst spawns the ranks itself with ``mp.spawn``,
which re-imports the script: hence the ``__main__`` guard.
"""

from __future__ import annotations

import shlex

import ast

from nbddp.contracts.devices import CPU_PROCESSES
from nbddp.contracts.errors import NbddpError
from nbddp.contracts.rank_env import RankEnv
from nbddp.engines.reading import parse
from nbddp.engines.engine import CellFacts, Engine, EngineCode


def code(returns: tuple[str, ...], script_name: str) -> EngineCode:
    if len(returns) != 1:
        raise NbddpError(
            f"the catalyst engine returns one thing, the runner's trained model; got --return "
            f"{','.join(returns)}. Return only the model variable (e.g. --return model)."
        )
    return EngineCode(
        imports=(
            "import nbddp.runtime_catalyst as _nbddp",
            "_nbddp.start()  # Catalyst's compatibility shims; the ranks are spawned by runner.train",
        ),
        train_prologue=(
            f"_nbddp.use_ddp(returns={list(returns)!r})  # runner.train(...) runs on Catalyst's DDP engine",
        ),
        train_epilogue=(
            f"_nbddp.finish(globals(), returns={list(returns)!r})",
        ),
        launch_hint=f"python {shlex.quote(script_name)}  (Catalyst spawns one process per GPU, or {CPU_PROCESSES} "
                    f"CPU processes without one; {RankEnv.shell(nproc='N')} chooses)",
        notes=("Catalyst's own logs and checkpoints go to the runner's logdir, relative to the folder it is "
               "launched from.",),
    )


def _trains_with(facts: CellFacts) -> bool:
    """A runner's ``.train(..., loaders=...)`` in a training cell, Catalyst imported (``Runner.train`` is
    keyword-only and ``loaders`` is required)."""
    return "catalyst" in facts.imported and any(_calls_runner_train(code) for code in facts.train_codes)


def _calls_runner_train(code: str) -> bool:
    tree = parse(code)
    for node in ast.walk(tree) if tree else ():
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "train"
            and any(k.arg == "loaders" for k in node.keywords)
        ):
            return True
    return False


ENGINE = Engine(
    "catalyst", lambda request: code(request.returns, request.script_name), packages=("catalyst",),
    trains_with=_trains_with, detected_by="runner.train(loaders=...)", spawns_its_own_ranks=True,
    shard_instead="Catalyst 22.4, its last release, has no FSDP2 engine")
