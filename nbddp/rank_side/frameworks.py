"""Accelerate, Lightning and the Hugging Face Trainer, adapted to the ranks torchrun started.

Runs in each rank, after :func:`nbddp.rank_side.torch_engine.start` joined the process group and before
the notebook's cells. Each adaptation is the smallest change that makes the library behave as it does
under its own multi-process launcher (``accelerate launch``, Lightning's ``ddp`` under torchrun), and
prints what it changed on rank 0. A patch is applied once per process and never undone: a rank runs
one job, or, warm, its next jobs find the patch in place (the libraries' shared state is reset per job).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import TYPE_CHECKING, Any, Callable, Sequence

from nbddp.contracts.errors import NbddpError
from nbddp.contracts.metrics import COUNTERS
from nbddp.rank_side import ranks

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

_MARK = "__nbddp_adapted__"


def adapt(framework: str, packages: Sequence[str]) -> None:
    """Adapt ``framework`` (an engine name) in the ``packages`` the notebook imports."""
    if framework == "accelerate":
        _adapt_accelerate()
    elif framework == "lightning":
        for package in packages:
            _adapt_lightning(package)
    elif framework == "transformers":
        _adapt_transformers()
    else:
        raise NbddpError(f"nbddp: no adaptation for {framework!r}; export the notebook again (nbddp export).")


def say(text: str) -> None:
    """One line from rank 0 about what nbddp changed."""
    if ranks.is_main():
        print(f"[nbddp] {text}", flush=True)


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)``, once (a warm rank's next job finds it done)."""
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    wrapped = make(original)
    setattr(wrapped, _MARK, True)
    setattr(owner, name, wrapped)


def _on_cpu() -> bool:
    return ranks.device().type == "cpu"


def _use_accelerate_on_cpu() -> None:
    """Accelerate (and the Trainer, built on it) counts CPU processes as one unless told it runs on CPU:
    ``accelerate launch --cpu`` says so with this variable; every rank of a CPU run says the same."""
    if _on_cpu():
        os.environ["ACCELERATE_USE_CPU"] = "true"
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # a warm rank's previous job's state
    GradientState._reset_state()


# ---------------------------------------------------------------- Accelerate

#: ``notebook_launcher``'s arguments that say where and how ranks meet: nbddp's launcher decides that.
_RENDEZVOUS = ("use_port", "master_addr", "rdzv_backend", "rdzv_endpoint", "rdzv_conf", "rdzv_id",
               "monitor_interval", "log_line_prefix_template")


def _adapt_accelerate() -> None:
    import accelerate
    import accelerate.launchers

    _use_accelerate_on_cpu()
    for owner in (accelerate, accelerate.launchers):
        _wrap(owner, "notebook_launcher", lambda original: notebook_launcher)
        _wrap(owner, "debug_launcher", lambda original: debug_launcher)


def notebook_launcher(function: Callable, args: tuple = (), num_processes: int | None = None,
                      mixed_precision: str = "no", *, node_rank: int = 0, num_nodes: int | None = None,
                      max_restarts: int | None = None, **rendezvous: Any) -> None:
    """Accelerate's ``notebook_launcher`` in a rank torchrun started: ``function(*args)``, here.

    ``num_processes`` chose the run's process count before launch (unless ``--gpus``/``--nproc`` did, or
    fewer GPUs are visible: :func:`nbddp.contracts.devices.notebook_devices`); here the function runs once in each
    of the run's ranks, whatever it says. ``mixed_precision`` means what it means to ``accelerate launch``;
    the nodes and restarts are nbddp's (``--nnodes``, ``--slurm``, ``--max-restarts``), so values given
    that disagree with them are refused (left out, they are the run's). ``node_rank`` is each node's own,
    given by nbddp.
    """
    from accelerate.utils import PrecisionType, patch_environment

    unknown = sorted(set(rendezvous) - set(_RENDEZVOUS))
    if unknown:
        raise TypeError(f"notebook_launcher() got an unexpected keyword argument {unknown[0]!r}")
    try:
        precision = PrecisionType(str(mixed_precision).lower())
    except ValueError:
        raise ValueError(f"notebook_launcher(mixed_precision={mixed_precision!r}): choose one of "
                         f"{PrecisionType.list()}.") from None
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
    if num_nodes is not None and num_nodes != nodes:
        raise NbddpError(f"notebook_launcher(num_nodes={num_nodes}): this run has {nodes} node(s); nbddp starts the "
                         f"nodes: run with --nnodes {num_nodes} (or --slurm --nodes {num_nodes}) and drop num_nodes.")
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if max_restarts is not None and max_restarts != restarts:
        raise NbddpError(f"notebook_launcher(max_restarts={max_restarts}): nbddp restarts the ranks: run with "
                         f"--max-restarts {max_restarts} and drop max_restarts.")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if num_processes is not None and num_processes != local:
        say(f"notebook_launcher(num_processes={num_processes}): running on {local} process(es) per node, as the "
            "run chose (one per visible GPU, or --gpus/--nproc)")
    say(f"notebook_launcher: {getattr(function, '__name__', 'function')}() runs in each of the "
        f"{ranks.world_size()} ranks torchrun started")
    with patch_environment(accelerate_mixed_precision=str(precision)):
        function(*args)


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> None:
    """Accelerate's CPU ``debug_launcher``: ``function(*args)`` in this rank, on the run's ranks."""
    notebook_launcher(function, args, num_processes)


# ---------------------------------------------------------------- Lightning

#: Lightning strategies that start their ranks by forking or spawning, and their torchrun counterpart's prefix.
_FORKING = ("ddp_notebook", "ddp_fork", "ddp_spawn")


def lightning_strategy(strategy: Any, world_size: int) -> Any:
    """The strategy a ``Trainer(strategy=...)`` runs with under torchrun: forking ones become ``ddp``."""
    if strategy is None or strategy == "auto":
        return "ddp" if world_size > 1 else "auto"
    if isinstance(strategy, str):
        for forking in _FORKING:
            if strategy == forking or strategy.startswith(forking + "_"):
                return "ddp" + strategy[len(forking):]
        return strategy
    if getattr(strategy, "_start_method", "popen") != "popen":  # DDPStrategy(start_method="fork") and alike
        strategy._start_method = "popen"
    return strategy


def _adapt_lightning(package: str) -> None:
    module = importlib.import_module("lightning.pytorch" if package == "lightning" else package)
    callback_base = module.Callback

    class NbddpMetrics(callback_base):  # type: ignore[misc, valid-type]
        """``trainer.callback_metrics`` to ``nbddp.log`` (the live view, ``metrics.jsonl``), rank 0 only."""

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:  # (lightning's or pytorch_lightning's)
            if trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
                _log_lightning(trainer, trainer.current_epoch)

        def on_train_epoch_end(self, trainer: Any, *args: Any) -> None:
            _log_lightning(trainer, trainer.current_epoch + 1)

    environments = importlib.import_module(f"{module.__name__}.plugins.environments")

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - Trainer.__init__ now, by name too
            _lightning_kwargs(kwargs)
            _use_torchrun_environment(kwargs, environments)
            kwargs["callbacks"] = [*_as_list(kwargs.get("callbacks")), NbddpMetrics()]
            original(self, *args, **kwargs)
        return __init__

    _wrap(module.Trainer, "__init__", make)


def _lightning_kwargs(kwargs: dict[str, Any]) -> None:
    """A ``Trainer``'s device arguments made those of this torchrun job, and what changed said on rank 0."""
    world, local = ranks.world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
    asked = {k: kwargs.get(k, "auto" if k != "num_nodes" else 1) for k in ("strategy", "devices", "num_nodes")}
    strategy = lightning_strategy(kwargs.get("strategy"), world)
    if _on_cpu() and isinstance(strategy, str) and strategy.startswith(("fsdp", "deepspeed")):
        raise NbddpError(f"Trainer(strategy={strategy!r}) trains on GPUs only (Lightning has no CPU path for it); "
                         "these ranks are CPU processes: use strategy='ddp' here, or run with --gpus.")
    kwargs["strategy"] = strategy
    kwargs["devices"], kwargs["num_nodes"] = local, nodes
    if not _is_lightning_accelerator(kwargs.get("accelerator")):
        kwargs["accelerator"] = "cpu" if _on_cpu() else "gpu"
    shown = ", ".join(f"{k}={v!r}" for k, v in asked.items() if k != "num_nodes" or v != 1)
    say(f"Trainer({shown}) runs as strategy={strategy!r} on {world} process(es) "
        f"({local} per node, {kwargs['accelerator']}), started by torchrun")


def _use_torchrun_environment(kwargs: dict[str, Any], environments: Any) -> None:
    """Ranks, world size and the rendezvous from torchrun's variables, whatever order this Lightning
    detects cluster environments in: on a Slurm node Slurm's variables are there too, and there one task
    per node runs torchrun, so ``SLURM_PROCID`` counts nodes, not ranks (Lightning 2.6 checks torchrun's
    first; nothing here depends on that)."""
    plugins = _as_list(kwargs.get("plugins"))
    if not any(isinstance(p, environments.ClusterEnvironment) for p in plugins):
        kwargs["plugins"] = [*plugins, environments.TorchElasticEnvironment()]


def _as_list(value: Any) -> list[Any]:
    """A ``Trainer`` argument that takes one object, a list of them, or ``None``, as a list."""
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _is_lightning_accelerator(value: Any) -> bool:
    """An ``Accelerator`` object the user built (kept) rather than a name (made this run's device)."""
    return value is not None and not isinstance(value, str)


def _log_lightning(trainer: Any, epoch: int) -> None:
    values = {k: float(v) for k, v in trainer.callback_metrics.items()
              if getattr(v, "numel", lambda: 1)() == 1 and k not in COUNTERS}
    epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
    ranks.log(epoch=epoch, **({"epochs": epochs} if epochs else {}), step=trainer.global_step, **values)


# ---------------------------------------------------------------- Hugging Face Trainer


#: The Trainer's end-of-training speed figures: not measures of the model (its ``train_loss`` is kept).
_TRAINER_SUMMARY = frozenset({"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"})


def _adapt_transformers() -> None:
    import transformers

    _use_accelerate_on_cpu()

    class NbddpLogs(transformers.TrainerCallback):
        """The Trainer's logs (loss, learning rate, epoch) to ``nbddp.log``, from the main process."""

        def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                   logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
            if not state.is_world_process_zero or not logs:
                return
            values = {k: v for k, v in logs.items()
                      if isinstance(v, (int, float)) and k not in COUNTERS and k not in _TRAINER_SUMMARY}
            ranks.log(epoch=logs.get("epoch", state.epoch), epochs=args.num_train_epochs,
                             step=state.global_step, steps=state.max_steps, **values)

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - Trainer.__init__ now, by name too
            original(self, *args, **kwargs)
            self.add_callback(NbddpLogs())
            say(f"{type(self).__name__}: trains on {self.args.world_size} process(es) started by torchrun "
                f"({self.args.parallel_mode.value}, {self.args.device.type}); its logs go to nbddp.log")
        return __init__

    _wrap(transformers.Trainer, "__init__", make)
