"""An object's state as a warm rank keeps it: what kind of object it is, its shallow state (read, compared,
put back in place), a checksum of a tensor's or an array's bytes, a digest of an opaque object's pickle.

:mod:`nbddp.rank_side.warm.kept_objects` records every object of a kept setup with these. Nothing here compares an
object with its own ``__eq__``: identities, numbers nbddp reads, and bytes. Library internals (torch's private
objects, logging, threads' locks…) are of the kind :data:`ATOMIC`: never looked into.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import hashlib
import io
import pickle
import random
import sys
import types
import weakref
import zlib
from typing import Any

#: An opaque object whose pickle is bigger than this can't be checked (so it isn't kept).
PICKLE_LIMIT = 256 << 20

#: The kinds of object: never looked into; looked into only (tuples, bound methods); containers; objects with
#: attributes; the notebook's classes, functions and local modules; tensors, NumPy arrays; random generators;
#: what only a pickle's digest can check; what can't be kept at all.
(ATOMIC, CHILDREN, LIST, DICT, SET, DEQUE, BYTES, OBJECT, CLASS, FUNCTION, MODULE, TENSOR, ARRAY, RNG, OPAQUE,
 UNKEEPABLE) = range(16)
_ATOMIC_TYPES = {type(None), bool, int, float, complex, str, bytes, range, slice, type(Ellipsis), type(NotImplemented),
                 types.CodeType, types.BuiltinFunctionType, types.WrapperDescriptorType, types.MethodWrapperType,
                 types.MethodDescriptorType, types.GetSetDescriptorType, types.MemberDescriptorType,
                 types.ClassMethodDescriptorType, weakref.ref, weakref.ProxyType, property, memoryview,
                 type(sys.stdout.write) if hasattr(sys.stdout, "write") else type(None)}
#: Modules whose objects are the library's own machinery: never looked into.
_INTERNAL = ("torch._", "torch.jit", "torch.fx", "torch.cuda", "torch.backends", "torch.autograd", "torch.utils.hooks",
             "pyarrow", "logging", "threading", "_thread", "multiprocessing.synchronize", "re", "typing", "abc",
             "enum", "datetime", "decimal", "fractions", "uuid", "pathlib", "importlib", "tokenize")
_NEVER_KEPT = {types.GeneratorType: "a generator", types.CoroutineType: "a coroutine",
               types.AsyncGeneratorType: "a generator"}


#: A closure cell or slot with nothing in it.
EMPTY = object()


def dunder(name: str) -> bool:
    """``__name__``, ``__file__``…: Python's own names, not the notebook's."""
    return name.startswith("__") and name.endswith("__")


def short(key: Any) -> str:
    """A dict key as a name shows it (``cfg['lr']``)."""
    text = repr(key) if isinstance(key, (str, int, float, bool, tuple)) else type(key).__name__
    return text if len(text) <= 40 else text[:37] + "…"


def kind_of_type(tp: type) -> int:
    """The kind of every object of type ``tp``, or ``-1`` when it depends on the object."""
    if tp in _ATOMIC_TYPES:
        return ATOMIC
    if tp is types.FunctionType or issubclass(tp, (type, io.IOBase, types.ModuleType)):
        return -1
    if tp in _NEVER_KEPT:
        return UNKEEPABLE
    torch = sys.modules.get("torch")
    if torch is not None:
        if issubclass(tp, torch.Tensor):
            return UNKEEPABLE if tp.__module__.startswith("torch.distributed") else TENSOR
        if issubclass(tp, torch.nn.Module):
            return OBJECT
        if issubclass(tp, torch.Generator):
            return RNG
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if issubclass(tp, numpy.ndarray):
            return ARRAY
        if issubclass(tp, (numpy.generic, numpy.dtype)):
            return ATOMIC
        if issubclass(tp, (numpy.random.Generator, numpy.random.RandomState, numpy.random.BitGenerator)):
            return RNG
    if issubclass(tp, random.Random):
        return RNG
    if issubclass(tp, (tuple, frozenset, types.MethodType, functools.partial)):
        return CHILDREN
    for base, kind in ((list, LIST), (dict, DICT), (set, SET), (collections.deque, DEQUE), (bytearray, BYTES)):
        if issubclass(tp, base):
            return kind
    module = tp.__module__ or ""
    if _never_kept_type(tp):
        return UNKEEPABLE
    if any(module == prefix or module.startswith(prefix if prefix.endswith("_") else prefix + ".")
           for prefix in _INTERNAL):
        return ATOMIC
    if tp.__dictoffset__ or slots(tp):
        return OBJECT
    return OPAQUE


def _never_kept_type(tp: type) -> bool:
    import socket
    import subprocess
    import threading

    module = tp.__module__ or ""
    return (issubclass(tp, (threading.Thread, socket.socket, subprocess.Popen))
            or (module.startswith("torch.distributed")
                and ("ProcessGroup" in tp.__name__ or tp.__name__ in ("Reducer", "Work", "Store", "TCPStore")))
            or (module.startswith("torch.cuda") and tp.__name__ == "CUDAGraph")
            or module.startswith("multiprocessing"))


def never_kept(obj: Any) -> str:
    tp = type(obj)
    if isinstance(obj, io.IOBase):
        return "an open file"
    if tp in _NEVER_KEPT:
        return _NEVER_KEPT[tp]
    if "ProcessGroup" in tp.__name__ or tp.__name__ == "Reducer":
        return "a process group"
    if tp.__name__ == "CUDAGraph":
        return "a CUDA graph"
    if issubclass(tp, __import__("threading").Thread):
        return "a thread"
    return f"a {tp.__name__}"


def slots(tp: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in tp.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return tuple(n for n in names if n not in ("__dict__", "__weakref__"))


def is_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def is_optimizer(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.optim.Optimizer)


def capture(kind: int, obj: Any) -> Any:
    """The object's shallow state: what :func:`same` compares and :func:`put_back` restores."""
    if kind in (LIST, DEQUE):
        return list(obj), _attributes(obj), getattr(obj, "maxlen", None)
    if kind == DICT:
        return list(obj.items()), _attributes(obj), getattr(obj, "default_factory", None)
    if kind == SET:
        return tuple(obj), _attributes(obj)
    if kind == BYTES:
        return bytes(obj), _attributes(obj)
    if kind == OBJECT:
        return _attributes(obj), {n: getattr(obj, n, EMPTY) for n in slots(type(obj))} or None, type(obj)
    if kind in (MODULE, CLASS):
        return dict(obj.__dict__)
    if kind == FUNCTION:
        cells = tuple(cell_contents(c) for c in (obj.__closure__ or ()))
        return obj.__defaults__, dict(obj.__kwdefaults__ or {}), dict(obj.__dict__), cells, obj.__code__
    if kind == TENSOR:
        return tensor_state(obj)
    if kind == ARRAY:
        if obj.dtype.hasobject:
            raise TypeError("an array of Python objects")
        return array_state(obj)
    if kind == RNG:
        return rng_state(obj)
    return None


def _attributes(obj: Any) -> dict | None:
    attributes = getattr(obj, "__dict__", None)
    return dict(attributes) if isinstance(attributes, dict) else None


def cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return EMPTY


def changed_mapping(current: dict | None, saved: dict | None) -> bool:
    if current is None or saved is None:
        return current is not saved and bool(current or saved)
    return len(current) != len(saved) or any(k not in saved or saved[k] is not v for k, v in current.items())


def _changed_items(current: list, saved: list) -> bool:
    return len(current) != len(saved) or any(a is not b for a, b in zip(current, saved))


def same(kind: int, then: Any, now: Any) -> bool:
    """Whether ``now`` (:func:`capture`'s) is the state ``then``: identities, and numbers nbddp reads."""
    if kind in (LIST, DEQUE):
        return not _changed_items(now[0], then[0]) and not changed_mapping(now[1], then[1]) and now[2] == then[2]
    if kind == DICT:
        return (len(now[0]) == len(then[0]) and all(a[0] is b[0] and a[1] is b[1] for a, b in zip(now[0], then[0]))
                and not changed_mapping(now[1], then[1]) and now[2] is then[2])
    if kind == SET:
        return {id(x) for x in now[0]} == {id(x) for x in then[0]} and not changed_mapping(now[1], then[1])
    if kind == BYTES:
        return now[0] == then[0] and not changed_mapping(now[1], then[1])
    if kind == OBJECT:
        return (not changed_mapping(now[0], then[0]) and not changed_mapping(now[1], then[1])) and now[2] is then[2]
    if kind in (MODULE, CLASS):
        return not changed_mapping(now, then)
    if kind == FUNCTION:
        return (now[0] is then[0] or (now[0] is not None and then[0] is not None
                                      and not _changed_items(list(now[0]), list(then[0])))) \
            and not changed_mapping(now[1], then[1]) and not changed_mapping(now[2], then[2]) \
            and not _changed_items(list(now[3]), list(then[3])) and now[4] is then[4]
    if kind == TENSOR:
        return now[:8] == then[:8] and now[8] is then[8] and not changed_mapping(now[9], then[9])
    if kind == ARRAY:
        return now == then
    if kind == RNG:
        return _rng_equal(now, then)
    return True


def put_back(kind: int, obj: Any, state: Any) -> None:
    """Restore a container's, an object's, a class's or a function's shallow state, in place."""
    if kind in (LIST, DEQUE, DICT, SET, BYTES) and state[1] is not None:
        obj.__dict__.clear()
        obj.__dict__.update(state[1])
    if kind == LIST:
        list.__setitem__(obj, slice(None), state[0])
    elif kind == DEQUE:
        obj.clear()
        obj.extend(state[0])
    elif kind == DICT:
        obj.clear()
        obj.update(state[0])
        if state[2] is not None:
            obj.default_factory = state[2]
    elif kind == SET:
        obj.clear()
        obj.update(state[0])
    elif kind == BYTES:
        obj[:] = state[0]
    elif kind == OBJECT:
        attributes, slots, klass = state
        if type(obj) is not klass:
            obj.__class__ = klass
        if attributes is not None:
            obj.__dict__.clear()
            obj.__dict__.update(attributes)
        for name, value in (slots or {}).items():
            if value is EMPTY:
                if hasattr(obj, name):
                    object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, value)
    elif kind == MODULE:
        obj.__dict__.clear()
        obj.__dict__.update(state)
    elif kind == CLASS:
        for name in [n for n in obj.__dict__ if n not in state]:
            delattr(obj, name)
        for name, value in state.items():
            if obj.__dict__.get(name, EMPTY) is not value and name not in ("__dict__", "__weakref__"):
                setattr(obj, name, value)
    elif kind == FUNCTION:
        defaults, kwdefaults, attributes, cells, code = state
        obj.__code__, obj.__defaults__, obj.__kwdefaults__ = code, defaults, kwdefaults or None
        obj.__dict__.clear()
        obj.__dict__.update(attributes)
        for cell, value in zip(obj.__closure__ or (), cells):
            if value is EMPTY:
                if cell_contents(cell) is not EMPTY:
                    del cell.cell_contents
            else:
                cell.cell_contents = value


def tensor_state(t: Any) -> tuple:
    try:
        version = t._version
    except RuntimeError:  # an inference tensor: no version counter (its checksum still tells)
        version = None
    grad = t.grad if t.is_leaf or t.retains_grad else None
    return (version, t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device,
            t.requires_grad, grad, dict(t.__dict__) if t.__dict__ else None)


def array_state(a: Any) -> tuple:
    return (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str, a.flags.writeable)


def array_sum(a: Any) -> int:
    """A CRC-32 of a NumPy array's bytes."""
    import numpy

    return zlib.crc32(memoryview(a if a.flags.c_contiguous else numpy.ascontiguousarray(a)).cast("B"))


def nbytes(obj: Any) -> int:
    """A tensor's or an array's size in bytes."""
    return obj.numel() * obj.element_size() if hasattr(obj, "element_size") else int(obj.nbytes)


_WEIGHTS: dict[str, Any] = {}


def tensor_sum(t: Any) -> int:
    """A checksum of a tensor's bytes: CRC-32 on the CPU, a position-weighted sum on a GPU (any single changed
    element changes it; so does a permutation)."""
    import torch

    t = t.detach()
    if t.layout != torch.strided or t.is_meta:
        raise TypeError("not a dense tensor")
    if t.numel() == 0:
        return 0
    if t.device.type == "cpu":
        t = t.contiguous()
        return zlib.crc32((ctypes.c_char * nbytes(t)).from_address(t.data_ptr()))
    data = t.contiguous().reshape(-1).view(torch.uint8)
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    words = data.view(torch.int32)
    chunk = 1 << 22
    weights = _WEIGHTS.get(str(t.device))
    if weights is None:
        generator = torch.Generator(device="cpu").manual_seed(20240607)
        weights = (torch.randint(1, 1 << 31, (chunk,), generator=generator, dtype=torch.int64) | 1).to(t.device)
        _WEIGHTS[str(t.device)] = weights
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), chunk):
        part = words[start:start + chunk].to(torch.int64)
        total += (part * weights[:part.numel()]).sum() + start
    return int(total)


class _Limited(io.RawIOBase):
    def __init__(self) -> None:
        self.digest, self.size = hashlib.sha1(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.size += len(data)
        if self.size > PICKLE_LIMIT:
            raise ValueError("too big to check")
        self.digest.update(data)
        return len(data)


def pickle_digest(obj: Any) -> bytes:
    sink = _Limited()
    pickle.Pickler(sink, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return sink.digest.digest()


def copy_of(kind: int, obj: Any) -> Any:
    """What an object is restored from: a tensor's copy on the CPU, an array's copy, a generator's state."""
    if kind == TENSOR:
        return obj.detach().to("cpu", copy=True)
    if kind == ARRAY:
        return obj.copy()
    return rng_state(obj)


def rng_state(obj: Any) -> Any:
    if isinstance(obj, random.Random):
        return obj.getstate()
    if hasattr(obj, "get_state") and not hasattr(obj, "bit_generator"):  # torch.Generator, numpy's RandomState
        state = obj.get_state()
        return state.clone() if hasattr(state, "clone") else state
    generator = getattr(obj, "bit_generator", obj)
    return generator.state


def set_rng(obj: Any, state: Any) -> None:
    if isinstance(obj, random.Random):
        obj.setstate(state)
    elif hasattr(obj, "set_state") and not hasattr(obj, "bit_generator"):
        obj.set_state(state)
    else:
        getattr(obj, "bit_generator", obj).state = state


def _rng_equal(a: Any, b: Any) -> bool:
    if hasattr(a, "equal"):
        return bool(a.equal(b))
    try:
        return pickle.dumps(a) == pickle.dumps(b)
    except Exception:  # noqa: BLE001 - a generator's state that won't pickle: not known to be equal
        return False


def available_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)
