"""The objects a warm rank keeps after a setup, what a run changed in them, and undoing it.

A warm rank keeps the objects its setup cells made (:mod:`nbddp.rank_side.warm.state`) so that the next
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

import functools
import io
import re
import sys
import types
from pathlib import Path
from typing import Any, Iterator

from nbddp.contracts.rank_memory import size
from nbddp.rank_side.warm.object_state import (
    ARRAY, ATOMIC, CHILDREN, CLASS, DEQUE, DICT, EMPTY, FUNCTION, LIST, MODULE, OBJECT, OPAQUE, RNG, SET,
    TENSOR, UNKEEPABLE, array_state, array_sum, available_memory, capture, changed_mapping, copy_of, dunder,
    is_module, is_optimizer, kind_of_type, nbytes, never_kept, pickle_digest, put_back, same, set_rng, short,
    tensor_state, tensor_sum)

#: Tensors and arrays up to this size are copied and restored whatever they are (cheaper than a question).
SMALL_BYTES = 1 << 20
#: The share of the machine's free memory that the copies may take; a setup whose copies need more is not kept.
COPY_SHARE = 0.5
#: More objects than this in a setup's namespace: it is not kept (checking them would cost what it saves).
MAX_OBJECTS = 1_000_000
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
            if not dunder(name) and name not in libraries]
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
        need = sum(nbytes(r.obj) for r in copied if r.kind in (TENSOR, ARRAY))
        available = available_memory() if available is None else available
        if need > COPY_SHARE * available:
            raise NotKept(f"copying what a run changes ({size(need)}) would not fit in memory ({size(available)} free)")
        for record in self.records.values():
            if record.kind in (TENSOR, ARRAY, OPAQUE):
                now = self._sum(record)
                if now != record.sum:
                    record.changed, record.sum = max(record.changed, last_cell), now
        for record in copied:
            record.copy = copy_of(record.kind, record.obj)

    def _to_copy(self) -> list[Record]:
        """The tensors and arrays restored from a copy: a module's parameters and buffers, an optimizer's state,
        what requires a gradient, anything small; random generators' states too (they are small)."""
        trained: set[int] = set()
        for record in self.records.values():
            obj = record.obj
            if record.kind == OBJECT and is_module(obj):
                for tensor in [*obj.__dict__.get("_parameters", {}).values(),
                               *obj.__dict__.get("_buffers", {}).values()]:
                    trained.update((id(tensor), id(getattr(tensor, "grad", None))))
            elif record.kind == OBJECT and is_optimizer(obj):
                for state in obj.__dict__.get("state", {}).values():
                    trained.update(map(id, state.values()) if isinstance(state, dict) else ())
        return [r for r in self.records.values()
                if (r.kind == TENSOR and (id(r.obj) in trained or r.obj.requires_grad or nbytes(r.obj) <= SMALL_BYTES))
                or (r.kind == ARRAY and r.obj.nbytes <= SMALL_BYTES) or r.kind == RNG]

    def drop_from(self, cell: int) -> None:
        """Forget what cell ``cell`` and later ones made (they run again)."""
        self.records = {oid: r for oid, r in self.records.items() if r.birth < cell}
        for record in self.records.values():
            if record.changed >= cell:
                record.changed = -1  # (only possible for what a later cell changed and is restored to before it)

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
                if obj.shape != record.copy.shape or array_state(obj)[:3] != record.state[:3]:
                    return False
                obj[...] = record.copy
                return True
            return array_state(obj) == record.state and self._sum(record) == record.sum
        if kind == OPAQUE:
            return self._sum(record) == record.sum
        if kind == RNG:
            set_rng(obj, record.copy if record.copy is not None else record.state)
            return True
        if not self._same(record):
            put_back(record.kind, record.obj, record.state)
        return True

    def _restore_tensor(self, record: Record) -> bool:
        """A tensor restored from its copy (its data, in place where its storage is still its own), or checked;
        then its ``requires_grad``, its gradient (the kept one, restored as a record of its own) and attributes."""
        import torch

        t = record.obj
        version, ptr, offset, shape, stride, dtype, device, requires_grad, grad, attributes = record.state
        if record.copy is None:  # checked, not copied: unchanged, or it can't be kept
            if tensor_state(t)[:7] != record.state[:7] or self._sum(record) != record.sum:
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
        if changed_mapping(t.__dict__ or None, attributes):
            t.__dict__.clear()
            t.__dict__.update(attributes or {})
        record.state = tensor_state(t)
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
                    copies += nbytes(t)
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
            kind = kind_of_type(tp)
            self._kinds[tp] = kind
        if kind >= 0:
            return kind
        if tp is types.FunctionType:
            return FUNCTION if self._notebook_globals(obj.__globals__) else ATOMIC
        if isinstance(obj, types.ModuleType):
            return MODULE if self._local(getattr(obj, "__file__", None)) else ATOMIC
        if isinstance(obj, type):
            module = sys.modules.get(obj.__module__)
            local = obj.__module__ == "__main__" or (module is not None
                                                     and self._local(getattr(module, "__file__", None)))
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
                yield value, record, f"[{short(key)}]"
        elif kind == SET:
            yield from ((item, record, "{…}") for item in record.state[0])
        elif kind in (OBJECT, MODULE, CLASS):
            attributes = record.state[0] if kind == OBJECT else record.state
            yield from ((value, record, f".{key}") for key, value in (attributes or {}).items()
                        if not (kind != OBJECT and dunder(key)))
            if kind == OBJECT and record.state[1]:
                yield from ((value, record, f".{key}") for key, value in record.state[1].items())
        elif kind == FUNCTION:
            defaults, kwdefaults, attributes, cells, _ = record.state
            yield from ((value, record, ".__defaults__") for value in defaults or ())
            yield from ((value, record, f".__kwdefaults__[{key!r}]") for key, value in (kwdefaults or {}).items())
            yield from ((value, record, f".{key}") for key, value in attributes.items())
            names = obj.__code__.co_freevars
            yield from ((value, record, f" (its {name})") for name, value in zip(names, cells) if value is not EMPTY)
        elif kind == TENSOR:
            if record.state[8] is not None:
                yield record.state[8], record, ".grad"
            yield from ((value, record, f".{key}") for key, value in (record.state[9] or {}).items())
        if kind in (LIST, DICT, DEQUE, SET) and record.state[1]:
            yield from ((value, record, f".{key}") for key, value in record.state[1].items())

    # ------------------------------------------------------------------ states
    def _capture(self, record: Record) -> None:
        """Read the object's shallow state into its record (an object that can't be read can't be kept)."""
        try:
            record.state = capture(record.kind, record.obj)
        except Exception as exc:  # noqa: BLE001 - an object nbddp can't read is one it can't keep
            record.kind, record.why = UNKEEPABLE, f"can't be read ({type(exc).__name__})"
        if record.kind == UNKEEPABLE and not record.why:
            record.why = never_kept(record.obj)

    def _same(self, record: Record) -> bool:
        """Whether the object is as its record says."""
        try:
            return same(record.kind, record.state, capture(record.kind, record.obj))
        except Exception:  # noqa: BLE001 - an object that can't be read now isn't as its record says
            return False

    def _sum(self, record: Record) -> Any:
        """A checksum of a tensor's or array's bytes; a digest of an opaque object's pickle (``None``: can't)."""
        try:
            if record.kind == TENSOR:
                return tensor_sum(record.obj)
            if record.kind == ARRAY:
                return array_sum(record.obj)
            if record.kind == OPAQUE:
                return pickle_digest(record.obj)
        except Exception:  # noqa: BLE001 - an object nbddp can't check is one it can't keep
            record.kind, record.why = UNKEEPABLE, f"a {type(record.obj).__name__} that can't be checked"
        return None
