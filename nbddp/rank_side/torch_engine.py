"""The torch engine's rank side and the API training cells use (``nbddp.prepare``, ``nbddp.log``, …).

The torch engine's script imports this module first: :func:`start` joins the process group under
torchrun, :func:`finish` returns the weights and leaves it. The plumbing shared with the Catalyst
engine (per-rank logs, error reports, done marks, a clean exit) is :mod:`nbddp.rank_side.process`. Run without a
launcher every helper degrades to a plain single process, so training cells also run in a kernel.

torch is imported here, never by ``import nbddp``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from nbddp.contracts import checkpoint
from nbddp.rank_side.process import (become_rank, checkpoint_path, collective_timeout, exchange_roster, leave_group,
                                     map_tracebacks_to_the_notebook, mark_done, refuse, restart_count, run_dir,
                                     skip_final_collection, use_notebook_folder)
from nbddp.contracts.rank_env import RankEnv
from nbddp.rank_side.debugger import breakpoint  # noqa: A004, F401 - nbddp.breakpoint(rank=0), the cells' API
from nbddp.rank_side.ranks import device, is_main, local_rank, rank, use_cuda, world_size  # (the cells' API)
from nbddp.rank_side.ranks import log  # noqa: F401 - nbddp.log(...), the cells' API
from nbddp.contracts.rundir import RunDir


# ---------------------------------------------------------------- lifecycle


def start(engine: str = "torch", *, shard: bool = False, framework: str | None = None,
          packages: tuple[str, ...] = ()) -> None:
    """Called by the torch engine's script at import time, in every process that imports it.

    Under torchrun: send output to the rank's log, record an uncaught exception, join the process
    group. Elsewhere: nothing that changes behaviour, so ``python train.py`` is a normal single process.
    ``shard``: every ``prepare(model)`` of this script shards (``--shard``); set for each job, so a warm
    rank's next job starts from what its own script says. (``engine``: only scripts exported by nbddp
    0.1 pass it; the Catalyst engine now starts through :mod:`nbddp.rank_side.catalyst_engine`.)
    """
    global _shard_by_default
    _shard_by_default = shard
    if engine != "torch":
        from nbddp.contracts.errors import NbddpError

        raise NbddpError(f"this script was exported by an older nbddp for the {engine} engine; export it again "
                         "(nbddp export NOTEBOOK) or run the notebook with nbddp run.")
    use_notebook_folder()
    if run_dir() is None:
        map_tracebacks_to_the_notebook()  # run by hand (python, a person's torchrun): tracebacks name the cells
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        become_rank(rank(), world_size())
        if use_cuda():
            torch.cuda.set_device(own_gpu())
        join_group(_attempt_store())
        nnodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
        if nnodes > 1:
            per_node = int(os.environ["LOCAL_WORLD_SIZE"])
            node = int(os.environ["GROUP_RANK"])
            exchange_roster(node, nnodes, rank(), range(node * per_node, (node + 1) * per_node))
    if "RANK" in os.environ and dist.is_initialized():
        from nbddp.rank_side import spawn

        spawn.adapt()  # mp.spawn(fn, ...) runs fn here; the code's own init_process_group joins this group
        spawn.new_job()
    if framework is not None:
        from nbddp.rank_side.frameworks import adapt

        adapt(framework, packages)


def own_gpu() -> int:
    """This rank's GPU index, checked before the first CUDA call: a rank without a GPU of its own (more
    processes started than GPUs) ends at once with one line saying what to run instead, exit 3."""
    from nbddp.contracts.devices import rank_gpu
    from nbddp.contracts.errors import DeviceError

    try:
        return rank_gpu(local_rank(), torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None)
    except DeviceError as exc:
        refuse(rank(), exc)


def join_group(store: Any, rank_: int | None = None, size: int | None = None) -> None:
    """Join the default process group through ``store`` (NCCL on GPUs, gloo on CPUs); a warm rank
    joins a new one, under a prefix of its own, after a job that didn't end well on every rank."""
    dist.init_process_group(
        **group_backend(use_cuda(), local_rank()), timeout=collective_timeout(), store=store,
        rank=rank() if rank_ is None else rank_, world_size=world_size() if size is None else size,
    )


def group_backend(cuda: bool, gpu: int, version: str = torch.__version__) -> dict[str, Any]:
    """``init_process_group``'s backend, and on GPUs the rank's own device: NCCL bound to ``cuda:gpu``
    (``device_id``, a ``torch.device`` since torch 2.2) forms its communicator at once on that GPU, and
    its collectives, barriers included, never guess the device (torch warns "barrier(): using the device
    under current context" on every GPU run otherwise). gloo (CPU ranks) takes no device.

    Not bound under torch 2.6 and 2.7.0 (``version``), whose NCCL hangs at random in collectives of a
    bound group (pytorch#153960, worked around in 2.7.1): there the ranks keep the warning.
    """
    if not cuda:
        return {"backend": "gloo"}
    if _binding_hangs(version):
        return {"backend": "nccl"}
    return {"backend": "nccl", "device_id": torch.device("cuda", gpu)}


def _binding_hangs(version: str) -> bool:
    import re

    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    major, minor, patch = (int(n) for n in found.groups()) if found else (0, 0, 0)
    return (major, minor) == (2, 6) or (major, minor, patch) == (2, 7, 0)


def _attempt_store() -> dist.Store:
    """The store this restart attempt's ranks meet in.

    Launched by nbddp on one machine (``NBDDP_STORE``): a FileStore of its own in the run's private folder,
    where no other host or user can read or write a key (:mod:`nbddp.launchers.private_rendezvous`).
    Otherwise (several nodes, an exported script under a person's own torchrun): torch's TCPStore at
    ``MASTER_ADDR``, the agent's own where torchrun shares it.

    One per attempt either way: with ``--max-restarts`` the agent's store outlives an attempt, so the
    ranks of attempt 1 could read the gloo addresses of attempt 0's dead ranks and hang or be refused.
    """
    from datetime import timedelta

    folder = RankEnv.from_environ().store
    if folder is not None:
        return dist.FileStore(str(folder / f"attempt-{restart_count()}"), world_size())
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size(),
        is_master=not agent_store and rank() == 0, timeout=timedelta(seconds=300),
        multi_tenant=not agent_store,
    )
    return dist.PrefixStore(f"nbddp/attempt_{restart_count()}", store)


def finish(namespace: dict[str, Any], returns: Iterable[str], mark: bool = True) -> None:
    """End of the training block: rank 0 saves the returned variables, then all leave the group.

    A sharded model (or its optimizer) is gathered first, by every rank, into rank 0's CPU memory.
    ``mark``: write this rank's done mark (the Catalyst engine's spawned ranks write their own).
    """
    names = list(returns)
    from nbddp.rank_side.sharding import modules_in

    values = _gathered({n: namespace[n] for n in names if n in namespace}, modules_in(namespace.values()))
    if is_main() and names:  # (none: the script returns nothing, and says why)
        missing = [n for n in names if n not in namespace]
        if missing:
            raise NameError(
                f"nbddp: cannot return {', '.join(missing)}: no such variable after the training "
                "cells. Name the variables to bring back with --return NAME[,NAME...]."
            )
        checkpoint.save_returns(values, checkpoint_path())
    me = rank()
    leave_group()
    if mark:
        mark_done(me)
    skip_final_collection()


def _gathered(values: dict[str, Any], modules: list[torch.nn.Module]) -> dict[str, Any]:
    """``values`` with every sharded model and optimizer replaced by its full state (rank 0) — a collective."""
    from nbddp.rank_side import sharding

    if not (dist.is_available() and dist.is_initialized()):
        return values

    def gathered(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: gathered(v) for k, v in value.items()}
        return sharding.gather_state(value, modules) if sharding.holds_shards(value) else value

    return {name: gathered(value) for name, value in values.items()}


# ---------------------------------------------------------------- user API

_shard_by_default = False
"""``--shard``: the script's :func:`start` says whether ``prepare(model)`` shards when not told."""


def prepare(obj: Any, shard: bool | None = None, *, blocks: Any = None, mixed_precision: Any = None,
            offload: bool = False) -> Any:
    """Make a model or data loader distributed; unchanged in a single process.

    * ``nn.Module`` → moved to this rank's device and wrapped in
      ``DistributedDataParallel``; with ``shard=True`` (or the run's ``--shard``), sharded with FSDP2
      instead (:func:`nbddp.rank_side.sharding.shard`): ``fully_shard`` on each of its ``blocks`` (default:
      its repeated submodules; or a list, a class, a test) and on the model. ``mixed_precision`` (a dtype
      or a ``MixedPrecisionPolicy``) and ``offload`` (parameters in CPU memory between uses, GPU runs)
      apply to sharded runs only, so the same cell runs either way. ``shard=False`` keeps DDP even under
      ``--shard``. Build the optimizer after ``prepare``: sharding replaces the parameters.
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
        if _shard_by_default if shard is None else shard:
            from nbddp.rank_side import sharding

            return sharding.shard(obj, device(), blocks, mixed_precision, offload)
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

    def __iter__(self) -> Iterator[Any]:
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


def resume_path() -> Path:
    directory = run_dir()
    return directory.resume if directory else checkpoint_path().with_name("resume.pt")


def save_checkpoint(**state: Any) -> None:
    """Save training state (modules, optimizers, counters) so a restarted run can resume.

    Rank 0 writes ``resume.pt`` atomically (a crash mid-save keeps the previous one); other
    ranks return at once. With a sharded model every rank writes its shard instead
    (:mod:`nbddp.rank_side.sharded_checkpoint`): call it on every rank, never under ``if is_main()``
    (rank 0 would wait for the others until the collective timeout). Pair it with :func:`restore`
    at the top of the training cell. In a Slurm job that requeues itself (``--requeue``) every rank
    must call it: after Slurm's signal, every rank stops at the same save (:mod:`nbddp.rank_side.requeue`).
    """
    from nbddp.rank_side import requeue, sharding

    if any(isinstance(v, dict) and sharding.sharded_modules(v.values()) for v in state.values()):
        from nbddp.contracts.errors import NbddpError

        raise NbddpError("nbddp.save_checkpoint: pass each sharded model by its own name "
                         "(save_checkpoint(encoder=encoder, decoder=decoder, ...)), not in a dict.")
    attempt = restart_count()
    stop = requeue.stop_here(attempt)  # decided before the write: see nbddp.rank_side.requeue
    if dist.is_available() and dist.is_initialized() and any(
            sharding.holds_shards(v) for v in state.values()):
        from nbddp.rank_side import sharded_checkpoint

        sharded_checkpoint.save(run_dir(), state, note=f"attempt {attempt}")
    elif is_main():
        checkpoint.save_returns(state, resume_path(), note=f"attempt {attempt}")
    if stop:
        requeue.stop(attempt, state)


def restore(source: str | Path | None = None, /, **objects: Any) -> dict[str, Any]:
    """Load the last :func:`save_checkpoint` into ``objects`` (modules/optimizers, by name).

    Returns the other saved values (e.g. ``{"epoch": 3}``), or ``{}`` on a fresh start, so::

        done = nbddp.restore(model=model, optimizer=optimizer)
        for epoch in range(done.get("epoch", -1) + 1, epochs): ...

    ``source``: a run dir (or its ``resume.pt`` / ``resume.dcp``) to restore from, e.g. in the kernel
    after a run; default: this run's own. A sharded checkpoint loads into any number of ranks, sharded or
    not, or into the kernel's plain model.
    """
    from nbddp.rank_side import sharded_checkpoint

    said = f"attempt {restart_count() + 1}: " if run_dir() is not None else ""
    sharded = sharded_checkpoint.latest(Path(source) if source is not None else resume_path().parent)
    if sharded is not None:
        values = sharded_checkpoint.restore(sharded, objects)
        print(f"[nbddp] {said}resumed from {sharded.parent.name}/{sharded.name}{_at(values)}", flush=True)
        return values
    if source is None:
        path = resume_path()
    else:
        path = Path(source) if Path(source).suffix == ".pt" else RunDir(Path(source)).resume
    if not path.exists():
        if source is not None:
            from nbddp.contracts.errors import CheckpointError

            raise CheckpointError(f"no checkpoint in {source}: the run saved none (nbddp.save_checkpoint).")
        return {}
    from nbddp.rank_side import sharding

    if any(sharding.holds_shards(obj) for obj in objects.values()):
        from nbddp.contracts.errors import CheckpointError

        raise CheckpointError(f"{path} was saved by a run without sharding (DDP); a sharded model can't resume "
                              "from it. Resume it without --shard (or shard=True), or start over in a new run dir.")
    states, _ = checkpoint.load_returns(path, mmap=False)  # rank 0 may replace the (shared) file meanwhile
    targets = {name: getattr(obj, "module", obj) for name, obj in objects.items()}  # through DDP wrappers
    checkpoint.load_into(targets, {k: v for k, v in states.items() if k in objects})
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):  # optimizer state was saved from the CPU copy
            for value in obj.state.values():
                for key, tensor in value.items():
                    if isinstance(tensor, torch.Tensor):
                        value[key] = tensor.to(device())
    rest = {k: v for k, v in states.items() if k not in objects}
    print(f"[nbddp] {said}resumed from {path.name}{_at(rest)}", flush=True)
    return rest


def _at(values: dict[str, Any]) -> str:
    """`` (epoch=3)``: the plain values a checkpoint holds, to say where a run resumed."""
    plain = [f"{k}={v}" for k, v in values.items() if isinstance(v, (int, float, str, bool))]
    return f" ({', '.join(plain)})" if plain else ""
