"""The part of nbddp that runs inside the ranks.

The generated script imports this module first. Launched by nbddp (``NBDDP_RUN_DIR``
set) each rank writes its output to ``logs/rank-N.log``, its uncaught exception
to ``errors/rank-N.json`` and, on rank 0, metrics to ``metrics.jsonl``: files,
not pipes, so a flood of output can never block a rank and a dying launcher
can't take a rank's last words with it. Run without a launcher every helper
degrades to a plain single process, so training cells also run in a kernel.

torch is imported here, never by ``import nbddp``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from nbddp import checkpoint

_ENGINE = "torch"


# ---------------------------------------------------------------- who am I


def rank() -> int:
    """Global rank of this process (0 in a single process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of processes in the job (1 in a single process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    """Rank on this machine: which GPU this process drives."""
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    """True on rank 0: the one process that logs metrics and saves weights."""
    return rank() == 0


def device() -> torch.device:
    """``cuda:<local_rank>`` on a GPU run, else ``cpu``."""
    if _use_cuda():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def _use_cuda() -> bool:
    return os.environ.get("NBDDP_DEVICE", "") != "cpu" and torch.cuda.is_available()


def run_dir() -> Path | None:
    value = os.environ.get("NBDDP_RUN_DIR")
    return Path(value) if value else None


# ---------------------------------------------------------------- lifecycle


def start(engine: str = "torch") -> None:
    """Called by the script at import time, in every process that imports it.

    Under torchrun (torch engine): send output to the rank's log, record an
    uncaught exception, join the process group. Elsewhere: nothing that
    changes behaviour, so ``python train.py`` is a normal single process.
    """
    global _ENGINE
    _ENGINE = engine
    cwd = os.getcwd()
    if cwd not in sys.path:  # a kernel imports modules from the notebook's folder; so do the ranks
        sys.path.insert(1, cwd)
    if engine == "catalyst":
        from nbddp import runtime_catalyst

        runtime_catalyst.apply_compat_shims()
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        become_rank(rank(), world_size())
        if _use_cuda():
            torch.cuda.set_device(local_rank())
        dist.init_process_group(
            backend="nccl" if _use_cuda() else "gloo", timeout=collective_timeout(),
            store=_attempt_store(), rank=rank(), world_size=world_size(),
        )


def _attempt_store():
    """torchrun's store, scoped to this restart attempt.

    With ``--standalone`` and ``--max-restarts``, the agent's store outlives an attempt, so the
    ranks of attempt 1 could read the gloo addresses of attempt 0's dead ranks and hang or be
    refused. A prefix per attempt keeps every attempt's keys apart.
    """
    from datetime import timedelta

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size(),
        is_master=not agent_store and rank() == 0, timeout=timedelta(seconds=300),
        multi_tenant=not agent_store,
    )
    return dist.PrefixStore(f"nbddp/attempt_{restart_count()}", store)


def become_rank(global_rank: int, size: int) -> None:
    """Per-rank plumbing shared by both engines: die with the parent, log to files."""
    _die_with_parent()
    directory = run_dir()
    if directory is None:
        print(f"[nbddp] rank {global_rank}/{size} started (pid {os.getpid()})", flush=True)
        return
    logs = directory / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fd = os.open(logs / f"rank-{global_rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    previous_hook = sys.excepthook

    def record(exc_type, exc, tb):  # noqa: ANN001 - the excepthook signature
        record_exception(global_rank, exc_type, exc, tb)
        previous_hook(exc_type, exc, tb)

    sys.excepthook = record
    ranks = directory / "ranks"
    ranks.mkdir(exist_ok=True)
    (ranks / f"rank-{global_rank}.json").write_text(
        json.dumps({"pid": os.getpid(), "world_size": size, "attempt": restart_count()}))
    print(f"[nbddp] rank {global_rank}/{size} started (pid {os.getpid()})", flush=True)


def mark_done(global_rank: int) -> None:
    """Tell the launcher this rank finished its training normally (see :mod:`nbddp.job`)."""
    directory = run_dir()
    if directory is not None:
        (directory / "ranks").mkdir(exist_ok=True)
        (directory / "ranks" / f"rank-{global_rank}.done").touch()


def record_exception(global_rank: int, exc_type, exc, tb) -> None:  # noqa: ANN001
    """Write ``errors/rank-N.json``: what the launcher shows, translated to the notebook."""
    directory = run_dir()
    if directory is None or exc_type in (KeyboardInterrupt, SystemExit):
        return
    errors = directory / "errors"
    errors.mkdir(parents=True, exist_ok=True)
    frames = [
        {"file": f.filename, "line": f.lineno, "function": f.name, "text": f.line or ""}
        for f in traceback.extract_tb(tb)
    ]
    report = {
        "rank": global_rank,
        "attempt": restart_count(),
        "time": time.time(),
        "type": exc_type.__name__,
        "message": str(exc),
        "frames": frames,
        "traceback": "".join(traceback.format_exception(exc_type, exc, tb)),
    }
    path = errors / f"rank-{global_rank}.json"
    path.write_text(json.dumps(report), encoding="utf-8")


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this rank when its parent (torchrun / Catalyst) dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def collective_timeout():
    """``--collective-timeout`` (set by the launcher): how long a rank waits for its peers in a
    collective before raising, instead of torch's 30 minutes for gloo."""
    from datetime import timedelta

    seconds = float(os.environ.get("NBDDP_COLLECTIVE_TIMEOUT", 0) or 0)
    return timedelta(seconds=seconds) if seconds > 0 else None


def finish(namespace: dict[str, Any], returns: Iterable[str], engine: str = "torch") -> None:
    """End of the training block: rank 0 saves the returned variables, then all leave the group."""
    names = list(returns)
    if engine == "catalyst":
        from nbddp import runtime_catalyst

        if runtime_catalyst.trained():
            return  # rank 0 of Catalyst's spawned processes already saved the trained model
    if is_main():
        missing = [n for n in names if n not in namespace]
        if missing:
            raise NameError(
                f"nbddp: cannot return {', '.join(missing)}: no such variable after the training "
                "cells. Name the variables to bring back with --return NAME[,NAME...]."
            )
        checkpoint.save_returns({n: namespace[n] for n in names}, checkpoint_path())
    me = rank()
    leave_group()
    if engine != "catalyst":
        mark_done(me)


def leave_group() -> None:
    """Wait for every rank, then leave the process group so that the rank can exit cleanly.

    Why not a plain ``barrier()`` + ``destroy_process_group()``: gloo runs collectives on worker
    threads, and a barrier keeps weak references to the collectives still in flight, typically
    DDP's last gradient all-reduce. That all-reduce captured torch's thread-local state during
    ``backward()``, which holds a Python object (autograd's ``contextvars`` context). The worker
    thread frees the barrier, and with it that object, *after* the main thread has seen the
    barrier complete; when the main thread has meanwhile reached interpreter shutdown, the
    worker's attempt to take the GIL makes CPython end the thread with ``pthread_exit``, whose
    unwinding through a ``noexcept`` destructor calls ``std::terminate``: "terminate called
    without an active exception", SIGABRT, a finished rank reported dead. Busy CPUs widen the
    window (1 run in ~10 with two runs and a CPU hog on two cores).

    So the barrier's work object is kept alive for the life of the process: the gloo thread
    never drops the last reference, nothing Python-owned is freed off the main thread, and the
    process ends through normal interpreter shutdown with exit status 0. Works the barrier
    did not capture were completely released before it started (gloo releases a finished work
    under the same lock the barrier takes to snapshot the in-flight ones).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    work = dist.barrier(async_op=True)
    work.wait()
    _keep_until_exit(work)
    dist.destroy_process_group()


def _keep_until_exit(obj: Any) -> None:
    """A reference that even interpreter shutdown (which clears module globals) never drops."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def checkpoint_path() -> Path:
    """``$NBDDP_CHECKPOINT``, else ``weights.pt`` in the run dir, else beside the script."""
    if os.environ.get("NBDDP_CHECKPOINT"):
        return Path(os.environ["NBDDP_CHECKPOINT"])
    directory = run_dir()
    if directory is not None:
        return directory / "weights.pt"
    main = getattr(sys.modules.get("__main__"), "__file__", None) or "train.py"
    return Path(main).with_suffix(".weights.pt")


# ---------------------------------------------------------------- user API


def prepare(obj: Any) -> Any:
    """Make a model or data loader distributed; unchanged in a single process.

    * ``nn.Module`` → moved to this rank's device and wrapped in
      ``DistributedDataParallel``.
    * ``DataLoader`` → the same loader (batch size *per process*, shuffle,
      collate_fn, workers, drop_last, pin_memory kept) over a
      ``DistributedSampler`` whose epoch advances each time it is iterated.
    """
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    distributed = dist.is_available() and dist.is_initialized()
    if isinstance(obj, torch.nn.Module):
        if not distributed:
            return obj
        obj = obj.to(device())
        ids = [local_rank()] if device().type == "cuda" else None
        return DistributedDataParallel(obj, device_ids=ids)
    if isinstance(obj, DataLoader):
        return _distributed_loader(obj) if distributed else obj
    raise TypeError(
        f"nbddp.prepare() takes an nn.Module or a DataLoader, not {type(obj).__name__}."
    )


class _EpochLoader(torch.utils.data.DataLoader):
    """A DataLoader that calls ``sampler.set_epoch`` each time a new pass starts."""

    def __iter__(self):
        self.sampler.set_epoch(self._nbddp_epoch)
        self._nbddp_epoch += 1
        return super().__iter__()


def _distributed_loader(loader: torch.utils.data.DataLoader) -> torch.utils.data.DataLoader:
    from torch.utils.data import DistributedSampler, RandomSampler

    if loader.batch_size is None:
        raise TypeError("nbddp.prepare(): loaders with batch_sampler are not supported; pass batch_size.")
    sampler = DistributedSampler(
        loader.dataset, shuffle=isinstance(loader.sampler, RandomSampler), drop_last=loader.drop_last
    )
    new = _EpochLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers,
    )
    new._nbddp_epoch = 0
    return new


def log(**metrics: Any) -> None:
    """Record metrics (epoch, step, loss, …) from rank 0: ``metrics.jsonl`` and the live view.

    Other ranks' calls are ignored, so the training loop needs no ``if``.
    """
    if not is_main():
        return
    record = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
    directory = run_dir()
    if directory is None:
        print("[nbddp.log] " + " ".join(f"{k}={v}" for k, v in record.items()), flush=True)
        return
    record["time"] = time.time()
    with open(directory / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")


def restart_count() -> int:
    """How many times torchrun restarted the ranks (``--max-restarts``); 0 on the first attempt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)


def resume_path() -> Path:
    directory = run_dir()
    return (directory / "resume.pt") if directory else checkpoint_path().with_name("resume.pt")


def save_checkpoint(**state: Any) -> None:
    """Save training state (modules, optimizers, counters) so a restarted run can resume.

    Rank 0 writes ``resume.pt`` atomically (a crash mid-save keeps the previous one); other
    ranks return at once. Pair it with :func:`restore` at the top of the training cell.
    """
    if is_main():
        checkpoint.save_returns(state, resume_path(), note=f"attempt {restart_count()}")


def restore(**objects: Any) -> dict[str, Any]:
    """Load the last :func:`save_checkpoint` into ``objects`` (modules/optimizers, by name).

    Returns the other saved values (e.g. ``{"epoch": 3}``), or ``{}`` on a fresh start, so::

        done = nbddp.restore(model=model, optimizer=optimizer)
        for epoch in range(done.get("epoch", -1) + 1, epochs): ...
    """
    path = resume_path()
    if not path.exists():
        return {}
    states, _ = checkpoint.load_returns(path)
    targets = {name: getattr(obj, "module", obj) for name, obj in objects.items()}  # through DDP wrappers
    checkpoint.load_into(targets, {k: v for k, v in states.items() if k in objects})
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):  # optimizer state was saved from the CPU copy
            for value in obj.state.values():
                for key, tensor in value.items():
                    if isinstance(tensor, torch.Tensor):
                        value[key] = tensor.to(device())
    print(f"[nbddp] restart {restart_count()}: resumed from {path.name}", flush=True)
    return {k: v for k, v in states.items() if k not in objects}


def use_catalyst_ddp(returns: Iterable[str] = ("model",)) -> None:
    """Make every Catalyst ``Runner.train`` below run on Catalyst's DDP engine.

    Catalyst returns the runner's trained model, under the first name of ``returns``.
    """
    from nbddp import runtime_catalyst

    runtime_catalyst.patch_runner_train(tuple(returns))
