"""``torch.multiprocessing.spawn`` in a rank: the function runs here, as this rank.

PyTorch's DDP tutorial, and libraries built the same way (AIToolbox's ``TrainLoop.fit(gpu_mode='ddp')``),
start their ranks themselves: ``mp.spawn(fn, args=(...), nprocs=n)`` starts ``n`` processes, each calling
``fn(index, *args)``, and ``fn`` joins a group with ``init_process_group(backend, rank=index,
world_size=n)`` after setting ``MASTER_ADDR``/``MASTER_PORT``. In a notebook that fails (the children
can't import the kernel's ``__main__``); under nbddp the ranks already exist, one per device, in a
group nbddp made. So in each rank:

* ``spawn``/``start_processes`` call ``fn(local_rank, *args)`` once, here (``local_rank``: the device
  index the tutorial uses), instead of starting processes. ``nprocs`` chose the run's process count
  before launch, unless ``--gpus``/``--nproc`` did (:func:`nbddp.engines.processes_asked`).
* the function's own ``init_process_group(...)`` joins nothing new: where ranks meet is nbddp's (its
  ``MASTER_ADDR``/``MASTER_PORT``/``init_method`` are ignored, and the variables restored), ``rank=`` and
  ``world_size=`` are checked against this rank's, ``nccl`` on CPU ranks is gloo; all said once, on
  rank 0. Its ``destroy_process_group()`` is harmless (:func:`nbddp.rank_side.process.guard_destroy`).

A ``spawn`` inside the function (a nested one), or in a process nbddp didn't start, is torch's own.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing

from nbddp.contracts.errors import NbddpError

#: The module ``torch.multiprocessing.spawn`` (the package's attribute of that name is the function).
_SPAWN_MODULE = importlib.import_module("torch.multiprocessing.spawn")
#: torch's own functions, before :func:`adapt` replaces them.
_TORCH_START = _SPAWN_MODULE.start_processes
_TORCH_INIT = dist.init_process_group

_MARK = "__nbddp_spawn__"
_state: dict[str, Any] = {"inside": False, "said": set(), "meeting": {}}


def adapt() -> None:
    """Replace ``spawn``, ``start_processes`` and ``init_process_group`` in this rank (once per process)."""
    if getattr(_SPAWN_MODULE.spawn, _MARK, False):
        return
    for module in (torch.multiprocessing, _SPAWN_MODULE):
        module.spawn, module.start_processes = spawn, start_processes
    import torch.distributed.distributed_c10d as c10d

    dist.init_process_group = c10d.init_process_group = init_process_group
    for function in (spawn, start_processes, init_process_group):
        setattr(function, _MARK, True)


def new_job() -> None:
    """A warm rank's next job: say everything again, and remember where its ranks meet."""
    _state["said"] = set()
    _state["meeting"] = {name: os.environ[name] for name in ("MASTER_ADDR", "MASTER_PORT") if name in os.environ}


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str = "spawn") -> Any:
    """``torch.multiprocessing.spawn`` in a rank: ``fn(local_rank, *args)``, here."""
    return start_processes(fn, args, nprocs, join, daemon, start_method)


def start_processes(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
                    start_method: str = "spawn") -> Any:
    """``torch.multiprocessing.start_processes`` in a rank: ``fn(local_rank, *args)``, here."""
    if _state["inside"] or not _in_group():
        return _TORCH_START(fn, args, nprocs, join, daemon, start_method)
    local, per_node = _local()
    name = getattr(fn, "__name__", "fn")
    if nprocs != per_node:
        _say_once("nprocs", f"mp.spawn(nprocs={nprocs}): {per_node} process(es) per node, as the launch options "
                  "chose (--gpus/--nproc)")
    _say_once("spawn", f"mp.spawn: {name}(local_rank, ...) runs once in each of the {dist.get_world_size()} "
              "ranks nbddp started")
    _state["inside"] = True
    try:
        fn(local, *args)
    finally:
        _state["inside"] = False
    return None if join else _Ran()


class _Ran:
    """What ``spawn(..., join=False)`` returns, for a function that has already run here."""

    processes: list = []

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        return True

    def pids(self) -> list[int]:
        return [os.getpid()]


def init_process_group(backend: Any = None, init_method: str | None = None, timeout: Any = None,
                       world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
                       pg_options: Any = None, device_id: Any = None, **more: Any) -> None:
    """``torch.distributed.init_process_group`` called by the training code in a rank already in nbddp's group.

    Without nbddp's group (a plain process), torch's own.

    Raises:
        NbddpError: ``rank=``/``world_size=`` that name another process of the run.
    """
    if not _in_group():
        if device_id is not None:
            more["device_id"] = device_id
        return _TORCH_INIT(backend, init_method, timeout, world_size, rank, store, group_name, pg_options, **more)
    real_rank, real_size = dist.get_rank(), dist.get_world_size()
    local, per_node = _local()
    given = [f"{name}={value!r}" for name, value in (("init_method", init_method), ("store", store)) if value]
    _restore_meeting()
    _say_once("init", "the training code's init_process_group(...) joins nbddp's process group (rank "
              f"{real_rank} of {real_size}); where the ranks meet is nbddp's to choose"
              + (f" ({', '.join(given)} and MASTER_ADDR/MASTER_PORT ignored)" if given else
                 " (MASTER_ADDR/MASTER_PORT ignored)"))
    asked = str(backend).lower() if backend is not None else None
    if asked and "nccl" in asked and dist.get_backend() != "nccl":
        _say_once("nccl", f"init_process_group({backend!r}): these ranks run on the CPU, so the group is gloo")
    check_rank(rank, world_size, real_rank, real_size, local, per_node)
    return None


def check_rank(rank: int, world_size: int, real_rank: int, real_size: int, local: int, per_node: int) -> None:
    """Whether the code's ``rank=``/``world_size=`` (``-1``: not given) can mean this rank.

    Right when they are the group's (one node: the spawn index is the global rank), or when they describe
    this node alone (several nodes: the tutorial passes the spawn index and its own process count), which
    is said; anything else names another process, and is refused before it can train on the wrong shard.

    Raises:
        NbddpError: the values name another rank, or a world of another size.
    """
    ranks_fit = rank in (-1, real_rank) and world_size in (-1, real_size)
    if ranks_fit:
        return
    if rank in (-1, local) and world_size in (-1, per_node) and real_size != per_node:
        _say_once("node", f"init_process_group(rank={rank}, world_size={world_size}) describes this node; nbddp's "
                  f"group spans every node: this process is rank {real_rank} of {real_size} (a sampler given the "
                  "code's values shards the data per node: give it dist.get_rank() and dist.get_world_size())")
        return
    raise NbddpError(
        f"init_process_group(rank={rank}, world_size={world_size}): this process is rank {real_rank} of "
        f"{real_size} (local rank {local} of {per_node} on its node). Pass the index mp.spawn gives the function "
        "as rank and the process count as world_size, or leave them out: nbddp sets them.")


def _in_group() -> bool:
    """A rank nbddp started, in the group it joined (the variables are torchrun's)."""
    return "LOCAL_RANK" in os.environ and dist.is_available() and dist.is_initialized()


def _local() -> tuple[int, int]:
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def _restore_meeting() -> None:
    """Put back the ``MASTER_*`` variables the training code set for its own meeting (a warm rank re-joins
    through nbddp's)."""
    for name, value in _state["meeting"].items():
        os.environ[name] = value


def _say_once(key: str, text: str) -> None:
    """One line from rank 0, once per job."""
    if key in _state["said"]:
        return
    _state["said"].add(key)
    if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))) == 0:
        print(f"[nbddp] {text}", flush=True)
