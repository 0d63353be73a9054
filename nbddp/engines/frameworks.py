"""The Accelerate, Lightning and Hugging Face Trainer engines: a notebook written for the library, unchanged.

Each library already knows how to be one rank of several when torchrun starts it (it reads ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``); what breaks in a notebook is that each also tries to *start* the
ranks itself, by forking the kernel (Accelerate's ``notebook_launcher``, Lightning's ``ddp_notebook``
and ``ddp_fork``), which fails once the kernel has touched CUDA and leaves the kernel's objects
untrained. So the script is the torch engine's, launched by torchrun like it, and its first lines ask
the rank side (:mod:`nbddp.rank_side.frameworks`) to adapt the library: the launcher runs the function
in the rank, the fork strategy becomes the matching torchrun one, and the library's logs reach
``nbddp.log``. What the rank changes it prints, so nothing happens behind the user's back.
"""

from __future__ import annotations

from typing import Any, Callable

from nbddp.engines.engine import CellFacts, CodeRequest, Engine, EngineCode, LaunchCall
from nbddp.engines.torch import default_hint

#: Accelerate's calls that start a notebook's training (nbddp's ranks run their function in place), and with
#: ``Accelerator(...)`` those that make a notebook Accelerate's.
ACCELERATE_LAUNCHERS = ("notebook_launcher", "debug_launcher")
_ACCELERATE_CALLS = frozenset({*ACCELERATE_LAUNCHERS, "Accelerator"})
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning")

#: What each library's adaptation does, for the script's header: the code the user would otherwise write.
ADAPTATIONS = {
    "accelerate": (
        "Accelerate: notebook_launcher(function, args, num_processes=N, mixed_precision=M) runs",
        "function(*args) in this rank (torchrun started the N ranks; mixed_precision as",
        "ACCELERATE_MIXED_PRECISION), and on CPU ranks ACCELERATE_USE_CPU=true, as `accelerate launch --cpu`",
        "sets it, so Accelerator() sees several gloo processes.",
    ),
    "lightning": (
        "Lightning: Trainer(strategy='ddp_notebook' | 'ddp_fork' | 'ddp_spawn' | 'auto', devices=...) runs as",
        "strategy='ddp' with devices/num_nodes/accelerator of this torchrun job (Lightning then joins the",
        "ranks torchrun started instead of forking); trainer.callback_metrics go to nbddp.log.",
    ),
    "transformers": (
        "Hugging Face Trainer: TrainingArguments picks up torchrun's ranks (on CPU ranks",
        "ACCELERATE_USE_CPU=true, as `accelerate launch --cpu` sets it); the Trainer's logs (loss,",
        "learning rate, epoch) go to nbddp.log.",
    ),
}


def code(engine: str, packages: tuple[str, ...], returns: tuple[str, ...], script_name: str) -> EngineCode:
    """The torch engine's script with the library ``engine`` (its ``packages``) adapted at import time."""
    return EngineCode(
        imports=(
            "import nbddp.runtime as _nbddp",
            f"_nbddp.start(framework={engine!r}, packages={packages!r})  # joins torchrun's group; "
            f"adapts {engine} to it (see above)",
        ),
        train_prologue=(),
        train_epilogue=(f"_nbddp.finish(globals(), returns={list(returns)!r})  # rank 0 saves the returned state",),
        launch_hint=default_hint(script_name),
        notes=ADAPTATIONS[engine],
    )


def _library(name: str, packages: tuple[str, ...], trains_with: Callable[[CellFacts], bool], detected_by: str,
             shard_instead: str, **more: Any) -> Engine:  # (more: Engine's other fields)
    def library_code(request: CodeRequest) -> EngineCode:
        return code(name, request.packages or packages[:1], request.returns, request.script_name)

    return Engine(name, library_code, packages=packages, library=True, trains_with=trains_with,
                  detected_by=detected_by, shard_instead=shard_instead, **more)


def _imports(facts: CellFacts | LaunchCall, packages: tuple[str, ...]) -> bool:
    return bool(facts.imported & set(packages))


def _accelerate_launches(call: LaunchCall) -> str | None:
    """``notebook_launcher(...)`` / ``debug_launcher(...)``."""
    return call.name if _imports(call, ("accelerate",)) and call.name in ACCELERATE_LAUNCHERS else None


def _lightning_launches(call: LaunchCall) -> str | None:
    """``trainer.fit(...)`` of a ``Trainer``, not scikit-learn's ``model.fit(X, y)``."""
    trainer = call.made_by.removesuffix("(...)") == "Trainer"
    return call.shown if call.name == "fit" and trainer and _imports(call, LIGHTNING_PACKAGES) else None


def _transformers_launches(call: LaunchCall) -> str | None:
    """``trainer.train()`` of a Hugging Face ``...Trainer``, not ``model.train()``."""
    trainer = call.made_by.removesuffix("(...)").endswith("Trainer")
    return call.shown if call.name == "train" and trainer and _imports(call, ("transformers",)) else None


ACCELERATE = _library(
    "accelerate", ("accelerate",),
    lambda facts: _imports(facts, ("accelerate",)) and bool(facts.trained & _ACCELERATE_CALLS),
    "notebook_launcher/Accelerator",
    "with Accelerate, shard with its own FSDP plugin (Accelerator(fsdp_plugin=...))",
    # An Accelerator built in a setup cell: the ranks must see it too.
    sets_up_with=lambda facts: _imports(facts, ("accelerate",)) and bool(facts.called & _ACCELERATE_CALLS),
    process_count=(("notebook_launcher",), "num_processes", 2),  # notebook_launcher(function, args, num_processes)
    launch_text="Accelerate's notebook_launcher(...)", launches=_accelerate_launches)
LIGHTNING = _library(
    "lightning", LIGHTNING_PACKAGES,
    lambda facts: _imports(facts, LIGHTNING_PACKAGES) and "fit" in facts.trained and "Trainer" in facts.called,
    "Trainer.fit",
    "with Lightning, shard with its own strategy (Trainer(strategy=\"fsdp\") on GPUs)",
    process_count=(("Trainer",), "devices", None), launch_text="a Lightning Trainer's .fit(...)",
    launches=_lightning_launches)
TRANSFORMERS = _library(
    "transformers", ("transformers",),
    lambda facts: (_imports(facts, ("transformers",)) and "train" in facts.trained
                   and any(name.endswith("Trainer") for name in facts.called)),
    "a Hugging Face Trainer's train()",
    "with the Hugging Face Trainer, shard with its own option (TrainingArguments(fsdp=...))",
    launch_text="a Hugging Face Trainer's .train()", launches=_transformers_launches)
