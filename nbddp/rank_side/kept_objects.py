"""The objects a warm rank keeps after a setup, what a run changed in them, and undoing it.

A warm rank keeps the objects its setup cells made (:mod:`nbddp.rank_side.warm_state`) so that the next
run skips those cells; that run must still start from the state *right after setup*, whatever the last
run did to it. So every object reachable from the setup's namespace gets a :class:`Record`: its shallow
state (a list's items, a dict's, an object's attributes, a tensor's version counter and storage) taken
after each setup cell, which says which cell made it (``birth``) and which cell last changed it
(``changed``). After a run, :meth:`KeptObjects.restore` puts each object back as it was after setup,
in place (identity matters: other objects and functions refer to them), or reports it when it can't:

* containers, attributes, closures, classes and functions of the notebook, random generators: always
  restored, from their shallow state;
* tensors a run is expected to change (parameters, buffers, optimizer state, anything that requires a
  gradient, anything small): restored from a copy taken after setup, kept **on the CPU** (the GPU holds
  only what a fresh run's setup would hold);
* other tensors and NumPy arrays (a dataset): checked, never copied: autograd's version counter, the
  storage, and a checksum of their bytes (which also sees writes that bypass the version counter,
  ``.data`` or a NumPy view); a changed one is reported;
* objects nbddp can't look into (a C extension's): a digest of their pickle, checked the same way;
* open files, generators, threads, process groups: never kept (reported as such).

Nothing is ever compared with an object's own ``__eq__``: identities, numbers nbddp reads, and bytes.
Library internals (modules, functions and classes not from the notebook, torch's private objects) are
not looked into: they are the library's, shared by every run in the process as before.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import hashlib
import io
import pickle
import random
import re
import sys
import types
import weakref
import zlib
from pathlib import Path
from typing import Any, Iterator

from nbddp.job.rank_memory import size

#: Tensors and arrays up to this size are copied and restored whatever they are (cheaper than a question).
SMALL_BYTES = 1 << 20
#: The share of the machine's free memory that the copies may take; a setup whose copies need more is not kept.
COPY_SHARE = 0.5
#: More objects than this in a setup's namespace: it is not kept (checking them would cost what it saves).
MAX_OBJECTS = 1_000_000
#: An opaque object whose pickle is bigger than this can't be checked (so it isn't kept).
PICKLE_LIMIT = 256 << 20

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


#: A module's parameters, buffers and submodules, named as torch names them (``model.0.weight``).
_MODULE_PARTS = re.compile(r"\._(parameters|buffers|modules)\['([^']*)'\]")


class Record:
    """One kept object: what it was after the last setup cell that ran, and where it came from."""

    __slots__ = ("obj", "kind", "birth", "changed", "state", "parent", "key", "sum", "copy", "why")

    def __init__(self, obj: Any, kind: int, birth: int, parent: "Record | None", key: str) -> None:
        self.obj, self.kind, self.birth, self.changed = obj, kind, birth, -1
        self.parent, self.key = parent, key
        self.state: Any = None
        self.sum: Any = None
        """A checksum of a tensor's or array's bytes, or an opaque object's pickle digest."""
        self.copy: Any = None
        """For what is restored from a copy: the copy (a tensor's is on the CPU)."""
        self.why = ""
        """For what can't be kept: what it is (``an open file``)."""

    def name(self) -> str:
        """Where it is in the namespace: ``model.fc.weight``, ``history[3]``."""
        parts, record = [], self
        while record is not None:
            parts.append(record.key)
            record = record.parent
        return _MODULE_PARTS.sub(r".\2", "".join(reversed(parts)))


class NotKept(Exception):
    """The setup's objects can't be kept at all (too many, too big to copy)."""


class KeptObjects:
    """Every object reachable from a namespace, recorded cell after cell, restored after each run."""

    def __init__(self, namespace: dict, folder: Path) -> None:
        self.namespace = namespace
        self.folder = str(Path(folder).resolve())
        self.records: dict[int, Record] = {}
        self.sealed = False
        self._kinds: dict[type, int] = {}

    # ------------------------------------------------------------------ recording
    def walk(self, cell: int, libraries: frozenset[str] = frozenset()) -> set[int]:
        """After setup cell ``cell`` ran: record each new object (made by it), note which recorded ones it changed,
        and let go of those no longer reachable (a later cell replaced them: a fresh run lets them go too).
        ``libraries``: names bound to what the cells imported from a library (``from lib import REGISTRY``):
        the library's state, not the setup's. Returns the ids of every object reached."""
        seen: set[int] = set()
        pending: list[tuple[Any, Record | None, str]] = [
            (value, None, name) for name, value in reversed(list(self.namespace.items()))
            if not _dunder(name) and name not in libraries]
        while pending:
            obj, parent, key = pending.pop()
            oid = id(obj)
            if oid in seen:
                continue
            seen.add(oid)
            record = self.records.get(oid)
            if record is None:
                kind = self.kind(obj)
                if kind == ATOMIC:
                    continue
                if len(self.records) >= MAX_OBJECTS:
                    raise NotKept(f"more than {MAX_OBJECTS:,} objects to check")
                record = self.records[oid] = Record(obj, kind, cell, parent, key)
                self._capture(record)
                record.sum = self._sum(record)
            elif not self._same(record):
                record.changed = cell
                self._capture(record)
                if record.kind in (TENSOR, ARRAY):
                    record.sum = self._sum(record)
            pending.extend(self._children(record))
        self.records = {oid: r for oid, r in self.records.items() if oid in seen}
        return seen

    def seal(self, last_cell: int, available: int | None = None) -> None:
        """Setup is over: copy what a run is expected to change, and take the checksums runs are checked against.

        A change that no version counter saw (``.data``, a NumPy view, an opaque object) shows here as a
        checksum that differs from the one taken when the object was last seen changing: it is then
        counted as changed by the last cell (its cell is unknown; erring late only re-runs more).

        Raises:
            NotKept: the copies would take more than :data:`COPY_SHARE` of ``available`` memory.
        """
        copied = self._to_copy()
        need = sum(_nbytes(r.obj) for r in copied if r.kind in (TENSOR, ARRAY))
        available = _available_memory() if available is None else available
        if need > COPY_SHARE * available:
            raise NotKept(f"copying what a run changes ({size(need)}) would not fit in memory ({size(available)} free)")
        for record in self.records.values():
            if record.kind in (TENSOR, ARRAY, OPAQUE):
                now = self._sum(record)
                if now != record.sum:
                    record.changed, record.sum = max(record.changed, last_cell), now
        for record in copied:
            record.copy = _copy(record)
        self.sealed = True

    def _to_copy(self) -> list[Record]:
        """The tensors and arrays restored from a copy: a module's parameters and buffers, an optimizer's state,
        what requires a gradient, anything small; random generators' states too (they are small)."""
        trained: set[int] = set()
        for record in self.records.values():
            obj = record.obj
            if record.kind == OBJECT and _is_module(obj):
                for tensor in [*obj.__dict__.get("_parameters", {}).values(), *obj.__dict__.get("_buffers", {}).values()]:
                    trained.update((id(tensor), id(getattr(tensor, "grad", None))))
            elif record.kind == OBJECT and _is_optimizer(obj):
                for state in obj.__dict__.get("state", {}).values():
                    trained.update(map(id, state.values()) if isinstance(state, dict) else ())
        return [r for r in self.records.values()
                if (r.kind == TENSOR and (id(r.obj) in trained or r.obj.requires_grad or _nbytes(r.obj) <= SMALL_BYTES))
                or (r.kind == ARRAY and r.obj.nbytes <= SMALL_BYTES) or r.kind == RNG]

    def drop_from(self, cell: int) -> None:
        """Forget what cell ``cell`` and later ones made (they run again)."""
        self.records = {oid: r for oid, r in self.records.items() if r.birth < cell}
        for record in self.records.values():
            if record.changed >= cell:
                record.changed = -1  # (only possible for what a later cell changed and is restored to before it)
        self.sealed = False

    # ------------------------------------------------------------------ after a run
    def restore(self) -> list[tuple[Record, str]]:
        """Put every kept object back as it was after setup; the ones that can't be, and why (``the last run
        changed X in place``, ``X (an open file) can't be kept``)."""
        problems = []
        for record in list(self.records.values()):
            try:
                ok = self._restore(record)
            except Exception:  # noqa: BLE001 - an object that refuses: it is re-made instead
                ok = False
            if not ok:
                problems.append((record, self._problem(record)))
        return problems

    def _problem(self, record: Record) -> str:
        if record.kind == UNKEEPABLE:
            return f"{record.name()} ({record.why}) can't be kept"
        if record.kind == OBJECT and type(record.obj) is not record.state[2]:
            return f"the last run turned {record.name()} into a {type(record.obj).__name__}"
        return f"the last run changed {record.name()} in place"

    def _restore(self, record: Record) -> bool:
        kind, obj = record.kind, record.obj
        if kind == UNKEEPABLE:
            return False
        if kind == OBJECT and type(obj) is not record.state[2] and not self._notebook_class(type(obj)):
            return False  # a library made it one of its own (FSDP2's sharded modules): its state is the library's
        if kind == TENSOR:
            return self._restore_tensor(record)
        if kind == ARRAY:
            if record.copy is not None:
                if obj.shape != record.copy.shape or _array_state(obj)[:3] != record.state[:3]:
                    return False
                obj[...] = record.copy
                return True
            return _array_state(obj) == record.state and self._sum(record) == record.sum
        if kind == OPAQUE:
            return self._sum(record) == record.sum
        if kind == RNG:
            _set_rng(obj, record.copy if record.copy is not None else record.state)
            return True
        if not self._same(record):
            _put_back(record)
        return True

    def _restore_tensor(self, record: Record) -> bool:
        """A tensor restored from its copy (its data, in place where its storage is still its own), or checked;
        then its ``requires_grad``, its gradient (the kept one, restored as a record of its own) and attributes."""
        import torch

        t = record.obj
        version, ptr, offset, shape, stride, dtype, device, requires_grad, grad, attributes = record.state
        if record.copy is None:  # checked, not copied: unchanged, or it can't be kept
            if _tensor_state(t)[:7] != record.state[:7] or self._sum(record) != record.sum:
                return False
        else:
            with torch.no_grad():
                if (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device) == \
                        (ptr, offset, shape, stride, dtype, device):
                    t.copy_(record.copy)
                elif self._shares_storage(record):
                    return False  # another kept tensor views its old storage: replacing it would part them
                else:
                    t.data = record.copy.to(device, copy=True)
        if t.is_leaf:
            if t.requires_grad != requires_grad:
                t.requires_grad_(requires_grad)
            if (t.grad if t.is_leaf else None) is not grad:
                t.grad = grad
        if _changed_mapping(t.__dict__ or None, attributes):
            t.__dict__.clear()
            t.__dict__.update(attributes or {})
        record.state = _tensor_state(t)
        return True

    def _shares_storage(self, record: Record) -> bool:
        ptr = record.state[1] - record.state[2] * record.obj.element_size()
        return any(r is not record and r.kind == TENSOR and r.state[6] == record.state[6]
                   and r.state[1] - r.state[2] * r.obj.element_size() == ptr for r in self.records.values())

    # ------------------------------------------------------------------ what it holds
    def sizes(self) -> tuple[list[tuple[str, int, int]], int]:
        """``([(name, CPU bytes, GPU bytes)], bytes of nbddp's copies)``: each namespace name's tensors and arrays
        (a storage counted once, for the first name that reaches it), largest first."""
        by_name: dict[str, list[int]] = {}
        storages: set[tuple[str, int]] = set()
        copies = 0
        for record in self.records.values():
            root = record
            while root.parent is not None:
                root = root.parent
            sizes = by_name.setdefault(root.key, [0, 0])
            if record.kind == TENSOR:
                t = record.obj
                key = (str(t.device), t.untyped_storage().data_ptr())
                if key not in storages:
                    storages.add(key)
                    sizes[t.device.type != "cpu"] += t.untyped_storage().nbytes()
                if record.copy is not None:
                    copies += _nbytes(t)
            elif record.kind == ARRAY:
                sizes[0] += record.obj.nbytes
                copies += record.obj.nbytes if record.copy is not None else 0
        found = [(name, cpu, gpu) for name, (cpu, gpu) in by_name.items() if name in self.namespace]
        return sorted(found, key=lambda item: -(item[1] + item[2])), copies

    # ------------------------------------------------------------------ kinds
    def kind(self, obj: Any) -> int:
        tp = type(obj)
        kind = self._kinds.get(tp)
        if kind is None:
            kind = _kind_of_type(tp)
            self._kinds[tp] = kind
        if kind >= 0:
            return kind
        if tp is types.FunctionType:
            return FUNCTION if self._notebook_globals(obj.__globals__) else ATOMIC
        if isinstance(obj, types.ModuleType):
            return MODULE if self._local(getattr(obj, "__file__", None)) else ATOMIC
        if isinstance(obj, type):
            module = sys.modules.get(obj.__module__)
            local = obj.__module__ == "__main__" or (module is not None and self._local(getattr(module, "__file__", None)))
            return CLASS if local else ATOMIC
        if isinstance(obj, io.IOBase):
            if obj in (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__) or obj.closed:
                return ATOMIC
            return UNKEEPABLE
        return OBJECT

    def _notebook_class(self, klass: type) -> bool:
        module = sys.modules.get(klass.__module__)
        return klass.__module__ == "__main__" or (module is not None and self._local(getattr(module, "__file__", None)))

    def _notebook_globals(self, namespace: dict) -> bool:
        return namespace is self.namespace or self._local(namespace.get("__file__"))

    def _local(self, path: str | None) -> bool:
        if not path:
            return False
        resolved = str(Path(path).resolve())
        return resolved.startswith(self.folder + "/") and "-packages/" not in resolved[len(self.folder):]

    def _children(self, record: Record) -> Iterator[tuple[Any, Record, str]]:
        kind, obj = record.kind, record.obj
        if kind in (LIST, DEQUE):
            yield from ((item, record, f"[{i}]") for i, item in enumerate(record.state[0]))
        elif kind == CHILDREN:
            if isinstance(obj, types.MethodType):
                yield from ((obj.__self__, record, ".__self__"), (obj.__func__, record, ".__func__"))
            elif isinstance(obj, functools.partial):
                yield from ((item, record, f".args[{i}]") for i, item in enumerate((obj.func, *obj.args)))
                yield from ((value, record, f"[{key!r}]") for key, value in (obj.keywords or {}).items())
            else:
                yield from ((item, record, f"[{i}]") for i, item in enumerate(obj))
        elif kind == DICT:
            for key, value in record.state[0]:
                yield key, record, ".keys()"
                yield value, record, f"[{_short(key)}]"
        elif kind == SET:
            yield from ((item, record, "{…}") for item in record.state[0])
        elif kind in (OBJECT, MODULE, CLASS):
            attributes = record.state[0] if kind == OBJECT else record.state
            yield from ((value, record, f".{key}") for key, value in (attributes or {}).items()
                        if not (kind != OBJECT and _dunder(key)))
            if kind == OBJECT and record.state[1]:
                yield from ((value, record, f".{key}") for key, value in record.state[1].items())
        elif kind == FUNCTION:
            defaults, kwdefaults, attributes, cells, _ = record.state
            yield from ((value, record, ".__defaults__") for value in defaults or ())
            yield from ((value, record, f".__kwdefaults__[{key!r}]") for key, value in (kwdefaults or {}).items())
            yield from ((value, record, f".{key}") for key, value in attributes.items())
            names = obj.__code__.co_freevars
            yield from ((value, record, f" (its {name})") for name, value in zip(names, cells) if value is not _EMPTY)
        elif kind == TENSOR:
            if record.state[8] is not None:
                yield record.state[8], record, ".grad"
            yield from ((value, record, f".{key}") for key, value in (record.state[9] or {}).items())
        if kind in (LIST, DICT, DEQUE, SET) and record.state[1]:
            yield from ((value, record, f".{key}") for key, value in record.state[1].items())

    # ------------------------------------------------------------------ states
    def _capture(self, record: Record) -> None:
        try:
            record.state = _capture(record)
        except Exception as exc:  # noqa: BLE001 - an object nbddp can't read is one it can't keep
            record.kind, record.why = UNKEEPABLE, f"can't be read ({type(exc).__name__})"
        if record.kind == UNKEEPABLE and not record.why:
            record.why = _never_kept(record.obj)

    def _same(self, record: Record) -> bool:
        try:
            return _same(record, _capture(record))
        except Exception:  # noqa: BLE001
            return False

    def _sum(self, record: Record) -> Any:
        """A checksum of a tensor's or array's bytes; a digest of an opaque object's pickle (``None``: can't)."""
        try:
            if record.kind == TENSOR:
                return _tensor_sum(record.obj)
            if record.kind == ARRAY:
                return zlib.crc32(memoryview(_contiguous(record.obj)).cast("B"))
            if record.kind == OPAQUE:
                return _pickle_digest(record.obj)
        except Exception:  # noqa: BLE001
            record.kind, record.why = UNKEEPABLE, f"a {type(record.obj).__name__} that can't be checked"
        return None


_EMPTY = object()


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _short(key: Any) -> str:
    text = repr(key) if isinstance(key, (str, int, float, bool, tuple)) else type(key).__name__
    return text if len(text) <= 40 else text[:37] + "…"


def _kind_of_type(tp: type) -> int:
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
    if tp.__dictoffset__ or _slots(tp):
        return OBJECT
    return OPAQUE


def _never_kept_type(tp: type) -> bool:
    import socket
    import subprocess
    import threading

    module = tp.__module__ or ""
    return (issubclass(tp, (threading.Thread, socket.socket, subprocess.Popen))
            or (module.startswith("torch.distributed") and ("ProcessGroup" in tp.__name__ or tp.__name__ in ("Reducer", "Work", "Store", "TCPStore")))
            or (module.startswith("torch.cuda") and tp.__name__ == "CUDAGraph")
            or module.startswith("multiprocessing"))


def _never_kept(obj: Any) -> str:
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


def _slots(tp: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in tp.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return tuple(n for n in names if n not in ("__dict__", "__weakref__"))


def _is_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _is_optimizer(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.optim.Optimizer)


def _capture(record: Record) -> Any:
    """The object's shallow state: what :func:`_same` compares and :func:`_put_back` restores."""
    kind, obj = record.kind, record.obj
    if kind in (LIST, DEQUE):
        return list(obj), _attributes(obj), getattr(obj, "maxlen", None)
    if kind == DICT:
        return list(obj.items()), _attributes(obj), getattr(obj, "default_factory", None)
    if kind == SET:
        return tuple(obj), _attributes(obj)
    if kind == BYTES:
        return bytes(obj), _attributes(obj)
    if kind == OBJECT:
        return _attributes(obj), {n: getattr(obj, n, _EMPTY) for n in _slots(type(obj))} or None, type(obj)
    if kind in (MODULE, CLASS):
        return dict(obj.__dict__)
    if kind == FUNCTION:
        cells = tuple(_cell(c) for c in (obj.__closure__ or ()))
        return obj.__defaults__, dict(obj.__kwdefaults__ or {}), dict(obj.__dict__), cells, obj.__code__
    if kind == TENSOR:
        return _tensor_state(obj)
    if kind == ARRAY:
        if obj.dtype.hasobject:
            raise TypeError("an array of Python objects")
        return _array_state(obj)
    if kind == RNG:
        return _rng_state(obj)
    return None


def _attributes(obj: Any) -> dict | None:
    attributes = getattr(obj, "__dict__", None)
    return dict(attributes) if isinstance(attributes, dict) else None


def _cell(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _changed_mapping(current: dict | None, saved: dict | None) -> bool:
    if current is None or saved is None:
        return current is not saved and bool(current or saved)
    return len(current) != len(saved) or any(k not in saved or saved[k] is not v for k, v in current.items())


def _changed_items(current: list, saved: list) -> bool:
    return len(current) != len(saved) or any(a is not b for a, b in zip(current, saved))


def _same(record: Record, now: Any) -> bool:
    kind, then = record.kind, record.state
    if kind in (LIST, DEQUE):
        return not _changed_items(now[0], then[0]) and not _changed_mapping(now[1], then[1]) and now[2] == then[2]
    if kind == DICT:
        return (len(now[0]) == len(then[0]) and all(a[0] is b[0] and a[1] is b[1] for a, b in zip(now[0], then[0]))
                and not _changed_mapping(now[1], then[1]) and now[2] is then[2])
    if kind == SET:
        return {id(x) for x in now[0]} == {id(x) for x in then[0]} and not _changed_mapping(now[1], then[1])
    if kind == BYTES:
        return now[0] == then[0] and not _changed_mapping(now[1], then[1])
    if kind == OBJECT:
        return (not _changed_mapping(now[0], then[0]) and not _changed_mapping(now[1], then[1])) and now[2] is then[2]
    if kind in (MODULE, CLASS):
        return not _changed_mapping(now, then)
    if kind == FUNCTION:
        return (now[0] is then[0] or (now[0] is not None and then[0] is not None and not _changed_items(list(now[0]), list(then[0])))) \
            and not _changed_mapping(now[1], then[1]) and not _changed_mapping(now[2], then[2]) \
            and not _changed_items(list(now[3]), list(then[3])) and now[4] is then[4]
    if kind == TENSOR:
        return now[:8] == then[:8] and now[8] is then[8] and not _changed_mapping(now[9], then[9])
    if kind == ARRAY:
        return now == then
    if kind == RNG:
        return _rng_equal(now, then)
    return True


def _put_back(record: Record) -> None:
    """Restore a container's, an object's, a class's or a function's shallow state, in place."""
    kind, obj, state = record.kind, record.obj, record.state
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
            if value is _EMPTY:
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
            if obj.__dict__.get(name, _EMPTY) is not value and name not in ("__dict__", "__weakref__"):
                setattr(obj, name, value)
    elif kind == FUNCTION:
        defaults, kwdefaults, attributes, cells, code = state
        obj.__code__, obj.__defaults__, obj.__kwdefaults__ = code, defaults, kwdefaults or None
        obj.__dict__.clear()
        obj.__dict__.update(attributes)
        for cell, value in zip(obj.__closure__ or (), cells):
            if value is _EMPTY:
                if _cell(cell) is not _EMPTY:
                    del cell.cell_contents
            else:
                cell.cell_contents = value


def _tensor_state(t: Any) -> tuple:
    try:
        version = t._version
    except RuntimeError:  # an inference tensor: no version counter (its checksum still tells)
        version = None
    grad = t.grad if t.is_leaf or t.retains_grad else None
    return (version, t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device,
            t.requires_grad, grad, dict(t.__dict__) if t.__dict__ else None)


def _array_state(a: Any) -> tuple:
    return (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str, a.flags.writeable)


def _contiguous(a: Any) -> Any:
    import numpy

    return a if a.flags.c_contiguous else numpy.ascontiguousarray(a)


def _nbytes(obj: Any) -> int:
    """A tensor's or an array's size in bytes."""
    return obj.numel() * obj.element_size() if hasattr(obj, "element_size") else int(obj.nbytes)


_WEIGHTS: dict[str, Any] = {}


def _tensor_sum(t: Any) -> int:
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
        return zlib.crc32((ctypes.c_char * _nbytes(t)).from_address(t.data_ptr()))
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


def _pickle_digest(obj: Any) -> bytes:
    sink = _Limited()
    pickle.Pickler(sink, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return sink.digest.digest()


def _copy(record: Record) -> Any:
    if record.kind == TENSOR:
        return record.obj.detach().to("cpu", copy=True)
    if record.kind == ARRAY:
        return record.obj.copy()
    return _rng_state(record.obj)


def _rng_state(obj: Any) -> Any:
    if isinstance(obj, random.Random):
        return obj.getstate()
    if hasattr(obj, "get_state") and not hasattr(obj, "bit_generator"):  # torch.Generator, numpy's RandomState
        state = obj.get_state()
        return state.clone() if hasattr(state, "clone") else state
    generator = getattr(obj, "bit_generator", obj)
    return generator.state


def _set_rng(obj: Any, state: Any) -> None:
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
    except Exception:  # noqa: BLE001
        return False


def _available_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)
