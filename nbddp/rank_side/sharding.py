"""Sharded training with FSDP2: what ``nbddp.prepare(model, shard=True)`` does, and how the weights come back.

DDP keeps the whole model, its gradients and its optimizer state on every rank. FSDP2
(``torch.distributed.fsdp.fully_shard``) splits each parameter across the ranks, gathers a block's
parameters just for its forward and backward, and leaves each rank one slice of every gradient and
optimizer state: the largest model that trains is about the ranks' memory together, not one rank's.

Three things differ from DDP, and each is handled here so the notebook needn't change:

* **Blocks.** FSDP2 gathers a unit at a time. :func:`blocks_of` picks the model's repeated submodules
  (a transformer's layers, a stack's ``Linear``\\s); each becomes a unit, then the root takes what is
  left, as FSDP2's documentation does it.
* **The parameters are replaced** by ``DTensor``\\s. An optimizer built before ``prepare`` would step
  tensors nobody uses: :func:`shard` arms a check that names the mistake at the first ``step()``.
* **Every rank takes part in a state dict.** :func:`gather_state` runs DCP's state-dict API
  (``full_state_dict=True, cpu_offload=True``), a collective; rank 0 receives plain CPU tensors and the
  kernel's model, never sharded, loads them as after DDP. Checkpoints for resuming are written by
  every rank, a shard each (:mod:`nbddp.rank_side.sharded_checkpoint`).

torch is imported here, never by ``import nbddp``.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from typing import Any, Callable, Iterable, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from nbddp.contracts.errors import NbddpError

#: What ``blocks=`` takes: the modules, a module class (or several), or a test on each submodule.
BlockPolicy = Union[Sequence[nn.Module], type, tuple, Callable[[nn.Module], bool], None]

_replaced: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
"""The parameters FSDP2 replaced, by id (a tensor's ``==`` is elementwise, so no set of tensors): an optimizer
that holds one was built before ``prepare``."""
_checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_hook: Any = None


def is_sharded(obj: Any) -> bool:
    """True for a module ``fully_shard`` was applied to.

    Importing FSDP takes about a second: a process that never loaded it (every DDP run) shards nothing,
    and asking must not cost a DDP run's end that second.
    """
    if "torch.distributed.fsdp" not in sys.modules and "torch.distributed._composable.fsdp" not in sys.modules:
        return False
    return isinstance(obj, fsdp2().FSDPModule)


def cpu_shards() -> bool:
    """FSDP2 shards on CPU ranks (gloo) from torch 2.6; torch 2.4's calls into CUDA on the way (seen: "CUDA driver
    version is insufficient" on a machine without a GPU). 2.5 was not tried: refused with 2.4."""
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.__version__) >= (2, 6)


def fsdp2() -> Any:
    """FSDP2's module (``fully_shard``, ``FSDPModule``, the policies): ``torch.distributed.fsdp`` from torch 2.6,
    ``torch.distributed._composable.fsdp`` in 2.4 and 2.5 (nbddp's oldest torch)."""
    from torch.distributed import fsdp

    if hasattr(fsdp, "fully_shard"):
        return fsdp
    from torch.distributed._composable import fsdp as composable

    return composable


def holds_shards(obj: Any) -> bool:
    """True for a sharded module, or an optimizer over a sharded module's parameters."""
    if isinstance(obj, torch.optim.Optimizer):
        return any(_is_dtensor(p) for group in obj.param_groups for p in group["params"])
    return is_sharded(obj)


def _is_dtensor(tensor: Any) -> bool:
    if "torch.distributed.tensor" not in sys.modules and "torch.distributed._tensor" not in sys.modules:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor

    return isinstance(tensor, DTensor)


def blocks_of(model: nn.Module, policy: BlockPolicy = None) -> list[nn.Module]:
    """The submodules to shard one by one, outermost first, never the root.

    ``policy``: ``None`` picks the outermost submodules whose class occurs at least twice with
    parameters (``nn.TransformerEncoderLayer``\\s, a stack's ``nn.Linear``\\s), looking inside containers
    (``ModuleList``, ``Sequential``, …) rather than taking them; a class or tuple of
    classes picks the outermost of those; a callable picks the outermost modules it returns True for;
    a list is taken as it is.

    Raises:
        NbddpError: a listed module is not a submodule of ``model``.
    """
    if isinstance(policy, (list, tuple)) and all(isinstance(m, nn.Module) for m in policy):
        inside = {id(m) for m in model.modules()}
        stray = [type(m).__name__ for m in policy if id(m) not in inside or m is model]
        if stray:
            raise NbddpError(f"nbddp.prepare(shard=True, blocks=[...]): {', '.join(stray)} is not a submodule of "
                             "the model being prepared; list the model's own blocks (e.g. model.layers).")
        return list(policy)
    if policy is None:
        counts = Counter(type(m) for m in model.modules()
                         if m is not model and _has_parameters(m) and not isinstance(m, _CONTAINERS))

        def wanted(m: nn.Module) -> bool:
            return counts[type(m)] >= 2
    elif isinstance(policy, (type, tuple)):
        def wanted(m: nn.Module) -> bool:
            return isinstance(m, policy)
    elif callable(policy):
        wanted = policy
    else:
        raise NbddpError(f"nbddp.prepare(shard=True, blocks=...): give a list of submodules, a module class or "
                         f"a function of a module, not {type(policy).__name__}.")
    return _outermost(model, lambda m: _has_parameters(m) and not isinstance(m, _CONTAINERS) and bool(wanted(m)))


#: Modules that only hold others: never a block by themselves (a ``ModuleList`` has no ``forward`` for FSDP2
#: to wrap; a whole ``Sequential`` stack gathered at once would save little); the search looks inside them.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _outermost(model: nn.Module, wanted: Callable[[nn.Module], bool]) -> list[nn.Module]:
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if wanted(child):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def shard(model: nn.Module, device: torch.device, blocks: BlockPolicy = None,
          mixed_precision: Any = None, offload: bool = False) -> nn.Module:
    """``fully_shard`` each block, then the root, over a mesh of every rank on ``device``'s type.

    ``mixed_precision``: a dtype (parameters gathered and computed in it, gradients reduced in float32)
    or a ``MixedPrecisionPolicy``. ``offload``: keep the shards in CPU memory between uses
    (``CPUOffloadPolicy``); on CPU ranks they are there already, so it changes nothing. The mesh is
    given explicitly: on a machine with GPUs and a gloo group FSDP2 would otherwise guess the device
    (pytorch#132471). Returns the same module object, now an ``FSDPModule``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cpu" and not cpu_shards():
        raise NbddpError(f"--shard on CPU ranks needs torch 2.6 or newer (this is torch {torch.__version__}, whose "
                         "FSDP2 calls into CUDA even for CPU shards): upgrade torch, train on GPUs, or drop --shard.")
    fsdp = fsdp2()
    fully_shard = fsdp.fully_shard
    if is_sharded(model):
        raise NbddpError("nbddp.prepare(model, shard=True): this model is sharded already; prepare it once.")
    # No model.to(device): fully_shard moves one block at a time to the mesh's device and shards it there,
    # so the whole model never sits on one GPU.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options: dict[str, Any] = {"mesh": mesh}
    if mixed_precision is not None:
        options["mp_policy"] = (mixed_precision if isinstance(mixed_precision, fsdp.MixedPrecisionPolicy)
                                else fsdp.MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32))
    if offload and device.type != "cpu":
        options["offload_policy"] = fsdp.CPUOffloadPolicy()
    if device.type == "cpu":
        _return_freed_buffers()
    before = list(model.parameters())
    for block in blocks_of(model, blocks):
        fully_shard(block, **options)
    fully_shard(model, **options)
    _arm_optimizer_check(before)
    return model


def _return_freed_buffers() -> None:
    """Have glibc give large freed buffers back to the system at once, as sharding on the CPU needs.

    FSDP2 gathers each block's parameters into a buffer, uses it and frees it, block after block. glibc's
    malloc raises its mmap threshold to the largest block it has freed (up to 32 MB), so from the second
    buffer on they come from the heap, and freed heap memory mostly stays with the process: a sharded
    rank's resident memory grew past DDP's (1.8 GB against 1.5 GB for 63M parameters here). A fixed
    1 MB threshold (``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_=1048576`` would) keeps it
    at what the rank holds (0.8 GB). It stays set for the process (a warm rank's later jobs too).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator has its own policy


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _arm_optimizer_check(replaced: Iterable[torch.Tensor]) -> None:
    """Name an optimizer built before ``prepare`` at its first step (it would train copies nobody uses)."""
    global _hook
    _replaced.update((id(p), p) for p in replaced)
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _checked:
        return
    _checked.add(optimizer)
    if any(_replaced.get(id(p)) is p for group in optimizer.param_groups for p in group["params"]):
        raise NbddpError(
            f"the {type(optimizer).__name__} was built before nbddp.prepare(model, shard=True): sharding replaced "
            "the model's parameters, so it would update copies the model no longer uses. Build the optimizer "
            "after prepare, from the prepared model's parameters.")


def model_of(optimizer: torch.optim.Optimizer, candidates: Iterable[Any]) -> nn.Module:
    """The module among ``candidates`` whose parameters ``optimizer`` updates (DCP's API needs both).

    Raises:
        NbddpError: none of them (the optimizer's model is not among the returned or saved objects).
    """
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)
    for candidate in candidates:
        module = getattr(candidate, "module", candidate)
        if isinstance(module, nn.Module) and any(p is first for p in module.parameters()):
            return module
    raise NbddpError(
        f"a {type(optimizer).__name__} of a sharded model is returned or saved without its model: its state is "
        "keyed by the model's parameter names. Return or save the model with it (e.g. --return model,optimizer).")


def gather_state(obj: Any, modules: Sequence[nn.Module]) -> Any:
    """The full, unsharded state of ``obj`` on rank 0 (CPU tensors), ``None`` on other ranks.

    A collective: every rank calls it, in the same order. ``modules``: the sharded models an optimizer
    may belong to. An optimizer's state comes back keyed by position, as ``Optimizer.state_dict()`` gives
    it, so the kernel's optimizer (built on the unsharded model) loads it as it is.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if isinstance(obj, torch.optim.Optimizer):
        state = get_optimizer_state_dict(model_of(obj, modules), obj, options=options)
        return by_position(state) if dist.get_rank() == 0 else None
    state = get_model_state_dict(obj, options=options)
    return state if dist.get_rank() == 0 else None


def by_position(state: dict[str, Any]) -> dict[str, Any]:
    """DCP's optimizer state (keyed by parameter name) → ``Optimizer.state_dict()``'s (keyed by position)."""
    position: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        names = group["params"]
        for name in names:
            position.setdefault(name, len(position))
        groups.append({**group, "params": [position[name] for name in names]})
    return {"state": {position[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def modules_in(values: Iterable[Any]) -> list[nn.Module]:
    """The modules among ``values`` and in dicts of them, through DDP wrappers: where an optimizer's model,
    or a sharded model, may be."""
    found: list[nn.Module] = []
    for value in values:
        if isinstance(value, dict):
            found += modules_in(value.values())
        elif isinstance(getattr(value, "module", value), nn.Module):
            found.append(value)
    return found


def sharded_modules(values: Iterable[Any]) -> list[nn.Module]:
    """The sharded modules among ``values`` (and in dicts of them)."""
    return [module for module in modules_in(values) if is_sharded(module)]
