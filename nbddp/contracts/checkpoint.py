"""The returned weights: atomic save on rank 0, safe CPU load in the kernel.

Saving writes the file whole or not at all (:mod:`nbddp.contracts.atomic`), so a crashed
rank or a full disk never leaves a truncated checkpoint where a good one was.
Like ``torch.save``, it leaves the flush to disk to the OS (no ``fsync``): that made the kernel wait for the disk,
over a second for a 400 MB checkpoint in BENCHMARKS.md's runs, to guard only
against the machine losing power in the seconds after the save. Loading always uses
``weights_only=True`` (never a full unpickle of a file a rank wrote) and
``map_location="cpu"``, so a model trained on GPUs is evaluated in a kernel
that has none, and ``mmap=True``: the tensors are read straight from the file
(usually still in the page cache, rank 0 having just written it) as
``load_state_dict`` copies them, with no second copy in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nbddp.contracts.atomic import replace_atomically
from nbddp.contracts.errors import CheckpointError

FORMAT = 1


def state_of(obj: Any) -> Any:
    """What to save for a returned variable: a module's or optimizer's state, else the value.

    DDP (and DataParallel) wrappers are stripped, so keys have no ``module.``
    prefix and load into the plain model in the kernel.
    """
    import torch

    if isinstance(obj, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        obj = obj.module
    if isinstance(obj, torch.nn.Module):
        return {k: v.detach().cpu() for k, v in obj.state_dict().items()}
    if isinstance(obj, torch.optim.Optimizer):
        return obj.state_dict()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: state_of(v) for k, v in obj.items()}
    return obj


def save_returns(values: dict[str, Any], path: str | Path, note: str = "") -> Path:
    """Atomically write ``{name: state}`` to ``path``; returns the path.

    What isn't weights or plain data (a ``DataLoader``, a dataset, a function) is left out, said in the note:
    a checkpoint is read back with ``weights_only=True``, which refuses any other object, and one such value
    must not cost the model that trained beside it."""
    states = {name: state_of(value) for name, value in values.items()}
    left_out = {name: type(values[name]).__name__ for name, state in states.items() if not _plain(state)}
    if left_out:
        said = ", ".join(f"{name} (a {kind})" for name, kind in left_out.items())
        note = "; ".join(filter(None, [note, f"{said} didn't come back: only modules, optimizers, tensors and plain "
                                             "values (numbers, text, lists and dicts of them) do"]))
    payload = {"nbddp": FORMAT, "note": note, "returns": {k: v for k, v in states.items() if k not in left_out}}
    return save_atomic(payload, path)


def _plain(state: Any) -> bool:
    """``state`` is what ``torch.load(weights_only=True)`` reads back, on every torch nbddp supports: tensors,
    numbers, text, ``None`` and lists, tuples and dicts of them. Exact types: a NumPy float or an enum is a
    subclass of ``float``/``int`` but is pickled as its own class, which that load refuses, and so is a
    ``defaultdict`` (only ``dict`` and ``OrderedDict`` are read)."""
    import collections

    import torch

    if state is None or type(state) in (bool, int, float, str) or isinstance(state, (torch.Tensor, torch.dtype,
                                                                                   torch.device, torch.Size)):
        return True
    if type(state) in (list, tuple):
        return all(_plain(item) for item in state)
    if type(state) in (dict, collections.OrderedDict):
        return all(_plain(key) and _plain(value) for key, value in state.items())
    return False


def save_atomic(payload: Any, path: str | Path) -> Path:
    """``torch.save`` to a temporary file beside ``path``, renamed over ``path`` once complete
    (:func:`nbddp.contracts.atomic.replace_atomically`).

    Raises:
        CheckpointError: naming the path, when the disk is full or unwritable;
            the previous file at ``path`` (if any) is left intact.
    """
    import torch

    path = Path(path)
    try:
        # by path: torch's own writer, faster than through a Python file object
        return replace_atomically(path, lambda tmp: torch.save(payload, tmp))
    except (OSError, RuntimeError) as exc:  # torch.save reports a short write (full disk, quota) as RuntimeError
        reason = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0]
        raise CheckpointError(f"could not write the checkpoint {path}: {reason}. "
                              "Free some disk space (or choose another --run-dir) and run again.") from exc


def load_returns(path: str | Path, mmap: bool = True) -> tuple[dict[str, Any], str]:
    """Read a checkpoint written by :func:`save_returns`: ``({name: state}, note)``, on the CPU.

    ``mmap``: the states' tensors are pages of the file until :func:`load_into` copies them out
    (which it always does), so pass it there and drop them; ``False`` reads them into memory.

    Raises:
        CheckpointError: missing, truncated, tampered with, or not nbddp's.
    """
    import pickle
    import torch

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the training did not save its result.")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"refusing the checkpoint {path}: it is truncated, corrupted or contains objects "
            f"that are not plain weights ({first}). Run the training again."
        ) from None
    if not isinstance(payload, dict) or payload.get("nbddp") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint written by nbddp.")
    return payload["returns"], payload.get("note", "")


def load_into(namespace: dict[str, Any], states: dict[str, Any]) -> list[str]:
    """Load each returned state into the object of the same name in ``namespace``.

    Modules and optimizers get ``load_state_dict``; other values are assigned, as is any state whose name the
    namespace lacks (what only a training cell defined: a module's or an optimizer's comes back as its state
    dict, said in the name returned). Nothing loaded shares memory with ``states`` (which may be pages of the
    checkpoint file, see :func:`load_returns`): the file can then be replaced or removed. Returns the names loaded.

    Raises:
        CheckpointError: the state
            doesn't fit the object (different architecture).
    """
    import torch

    loaded = []
    for name, state in states.items():
        if name not in namespace:  # (a training cell made it): it comes back as what was saved, said
            namespace[name] = _owned(state)
            loaded.append(f"{name} (as saved: the kernel had no {name} to load it into)"
                          if isinstance(state, dict) else name)
            continue
        target = namespace[name]
        try:
            if isinstance(target, torch.nn.Module):
                target.load_state_dict(state)  # copies into the module's own parameters
            elif isinstance(target, torch.optim.Optimizer):
                target.load_state_dict(_owned(state))  # an optimizer keeps the tensors it is given
            elif isinstance(target, dict) and isinstance(state, dict) and all(
                isinstance(v, torch.nn.Module) for v in target.values()
            ):
                for key, module in target.items():
                    module.load_state_dict(state[key])
            else:
                namespace[name] = _owned(state)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(
                f"the trained weights don't fit the notebook's {name!r} "
                f"({type(target).__name__}): {str(exc).splitlines()[0]}. Did the model's "
                "definition change since training? Run the cells defining it again."
            ) from None
        loaded.append(name)
    return loaded


def _owned(state: Any) -> Any:
    """``state`` with every tensor copied into memory of its own (not pages of a mapped file)."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {key: _owned(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_owned(value) for value in state)
    return state
