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
from nbddp.engines.reading import name_of, parse
from nbddp.engines.engine import CellFacts, Engine, EngineCode, LaunchCall

#: Catalyst's engines that run a training as DDP ranks (Catalyst 22.4's ``dl.DistributedDataParallelEngine``).
DDP_ENGINES = ("DistributedDataParallelEngine",)


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


def _launches(call: LaunchCall) -> str | None:
    """A runner's ``.train(...)`` that asks for DDP as Catalyst's tutorial writes it: ``ddp=True``,
    ``engine=dl.DistributedDataParallelEngine()`` (or a variable assigned one), or a runner of the notebook's own
    class whose ``get_engine`` returns one. A ``.train(...)`` that doesn't ask trains on one process: not a launch."""
    if call.name != "train" or not call.shown or "catalyst" not in call.imported:
        return None
    keywords = {k.arg: k.value for k in call.call.keywords}
    ddp = keywords.get("ddp")
    if isinstance(ddp, ast.Constant) and ddp.value is True:
        return f"{call.shown}(ddp=True)"
    if _is_ddp_engine(keywords.get("engine"), call):
        return f"{call.shown}(engine=DistributedDataParallelEngine)"
    runner = call.classes.get(call.made_by.removesuffix("(...)"))
    if runner is not None and _gets_ddp_engine(runner, call):
        return f"{call.shown} ({runner.name}.get_engine: DistributedDataParallelEngine)"
    return None


def _is_ddp_engine(value: ast.expr | None, call: LaunchCall) -> bool:
    """``DistributedDataParallelEngine(...)``, or a variable the notebook assigned one."""
    if isinstance(value, ast.Call):
        return name_of(value.func) in DDP_ENGINES
    return isinstance(value, ast.Name) and call.built.get(value.id) in DDP_ENGINES


def _gets_ddp_engine(runner: ast.ClassDef, call: LaunchCall) -> bool:
    """The runner class defines ``get_engine`` and it returns a DDP engine."""
    return any(isinstance(method, ast.FunctionDef) and method.name == "get_engine"
               and any(isinstance(node, ast.Return) and _is_ddp_engine(node.value, call) for node in ast.walk(method))
               for method in runner.body)


ENGINE = Engine(
    "catalyst", lambda request: code(request.returns, request.script_name), packages=("catalyst",),
    trains_with=_trains_with, detected_by="runner.train(loaders=...)", spawns_its_own_ranks=True,
    shard_instead="Catalyst 22.4, its last release, has no FSDP2 engine",
    launch_text="a Catalyst runner's .train(..., ddp=True) (or a DistributedDataParallelEngine)",
    unlaunched_hint="A Catalyst runner's .train(...) here asks for no DDP: pass ddp=True to it (or "
                    "engine=dl.DistributedDataParallelEngine()), or mark the cells.",
    launches=_launches)
