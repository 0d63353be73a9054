"""Checkpoints of sharded training: every rank writes its shard, no rank holds the whole model.

``nbddp.save_checkpoint`` with a sharded model (or its optimizer) lands here. It saves with
``torch.distributed.checkpoint`` (DCP) into a new ``save-*`` folder of the run dir's ``resume.dcp/``;
once DCP's own final step says every shard and the metadata are written, rank 0 points
``latest.json`` at it (atomically) and removes the previous save. A rank that dies mid-save leaves
``latest.json`` on the previous complete save, as ``resume.pt`` stays whole for DDP.

Restoring reads the folder ``latest.json`` names into whatever the objects are now: sharded over the
same ranks, over a different number of ranks (DCP reshards), or a plain model in a kernel (DCP reads
without a process group). Values that are not modules or optimizers (``epoch=3``) are rank 0's, kept
beside the shards in ``extras.pt``.

The folder must be one every rank can reach: on one machine it always is; across nodes it is node 0's
run dir, so that must be on a shared filesystem (or every node's run dir the same shared path).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nbddp.contracts import checkpoint
from nbddp.contracts.atomic import read_json, write_json
from nbddp.contracts.errors import CheckpointError
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.owned import check_owned
from nbddp.rank_side import sharding

EXTRAS = "extras.pt"


def _states(objects: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(DCP state dict, other values)``: modules and optimizers as DCP's state-dict API gives them (sharded
    where they are), everything else apart."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    modules = sharding.modules_in(objects.values())
    states: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for name, value in objects.items():
        if isinstance(value, torch.optim.Optimizer):
            states[name] = get_optimizer_state_dict(sharding.model_of(value, modules), value)
        elif isinstance(value, nn.Module):
            states[name] = get_model_state_dict(value)
        else:
            extras[name] = value
    return states, extras


def save(run_dir: RunDir | None, objects: dict[str, Any], note: str) -> Path:
    """Every rank: write this rank's shard of ``objects`` to a new save; rank 0 then makes it the latest.

    A collective: every rank calls it. ``run_dir``: the run's (``None`` outside a launcher: the folder
    beside the script). Returns the save.

    Raises:
        CheckpointError: the save could not be written (a full disk, an unwritable folder).
    """
    import os
    import time

    import torch.distributed.checkpoint as dcp

    if run_dir is None:
        from nbddp.rank_side.process import checkpoint_path

        run_dir = RunDir(checkpoint_path().parent)
    run_dir.resume_shards.mkdir(parents=True, exist_ok=True)
    states, extras = _states(objects)
    # rank 0 names it, for every node (one shared place) and every run of the script (never a name in use)
    target = str(run_dir.resume_shards / f"save-{time.time_ns():x}-{os.getpid()}-{note.replace(' ', '')}")
    path = Path(_from_rank_0(target) if dist.is_initialized() else target)
    try:
        dcp.save(states, checkpoint_id=path)  # returns once every shard and the metadata are written
        if not dist.is_initialized() or dist.get_rank() == 0:
            checkpoint.save_returns(extras, path / EXTRAS, note=note)
            write_json(run_dir.latest_shards, {"save": path.name, "note": note})
    except (OSError, RuntimeError, _checkpoint_exception()) as exc:
        raise CheckpointError(f"could not write the sharded checkpoint {path}: {_first_line(exc)}. Free some disk "
                              "space (or choose another --run-dir) and run again.") from None
    if not dist.is_initialized() or dist.get_rank() == 0:
        for old in run_dir.resume_shards.glob("save-*"):  # the previous save, and any a crash left half-written
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    return path


def _from_rank_0(text: str) -> str:
    """Rank 0's ``text``, on every rank: its UTF-8 bytes in a tensor. (``broadcast_object_list`` pickles, and each
    rank would unpickle what reaches its process group's sockets: nbddp's own messages between ranks never do.)"""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    return bytes(data.cpu().tolist()).decode()


def _checkpoint_exception() -> type[BaseException]:
    """DCP's own failure (it derives from ``BaseException``, so ``except Exception`` misses it)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _pointed(run_dir: RunDir) -> Path | None:
    pointer = read_json(run_dir.latest_shards)
    return None if pointer is None else run_dir.resume_shards / pointer["save"]


def latest(source: Path) -> Path | None:
    """The last complete sharded save that ``source`` names (a run dir, its ``resume.dcp`` folder, or one
    save), or ``None``."""
    source = Path(source)
    if (source / ".metadata").is_file():
        return source
    in_resume_folder = source.name == RunDir(source.parent).resume_shards.name
    found = _pointed(RunDir(source.parent if in_resume_folder else source))
    return found if found is not None and found.is_dir() else None


def restore(path: Path, objects: dict[str, Any]) -> dict[str, Any]:
    """Load the save at ``path`` into ``objects`` (on every rank, or alone in a kernel); returns the saved
    values that are not among ``objects``.

    Raises:
        CheckpointError: the save is incomplete, or doesn't fit the objects (a different model).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    saved = _saved_names(path)
    wanted = {name: obj for name, obj in objects.items() if name in saved}
    states, _ = _states(wanted)
    modules = sharding.modules_in(objects.values())
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
            dcp.load(states, checkpoint_id=path)
        for name, state in states.items():
            obj = wanted[name]
            if isinstance(obj, torch.optim.Optimizer):
                set_optimizer_state_dict(sharding.model_of(obj, modules), obj, state)
            else:
                set_model_state_dict(obj, state)
    except (RuntimeError, KeyError, ValueError, _checkpoint_exception()) as exc:
        raise CheckpointError(f"the sharded checkpoint {path} doesn't fit: {_first_line(exc)}. "
                              "Did the model's definition change since it was saved?") from None
    extras, _ = checkpoint.load_returns(path / EXTRAS, mmap=False)
    return {k: v for k, v in extras.items() if k not in objects}


def _saved_names(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    _yours_alone(path)
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path} is not a complete sharded checkpoint ({exc}).") from None
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def _yours_alone(path: Path) -> None:
    """torch's DCP reads a save's ``.metadata`` with ``pickle.load`` (and its shards' non-tensor items with
    ``torch.load``): a save someone else wrote, or could have changed, would run their code here. So every
    file of the save, and its folder, must be the user's and writable by nobody else (:mod:`nbddp.contracts.owned`).

    Raises:
        NotYours: it isn't (one line: whose it is). CheckpointError: the save isn't there.
    """
    what = "the sharded checkpoint"
    try:
        check_owned(path, what, follow=True)
        for entry in Path(path).iterdir():
            check_owned(entry, what + "'s file", then="Restore only a checkpoint of your own.")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete sharded checkpoint (it isn't there).") from None
