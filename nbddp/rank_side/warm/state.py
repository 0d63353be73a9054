"""A warm rank's setup, kept from one run to the next: only what changed runs again, and a run still
starts from the state a fresh run's setup leaves.

A warm rank runs a job's script unit by unit (:mod:`nbddp.rank_side.warm.script_units`): each setup cell
alone; nbddp's own lines and a parameters cell made of literals (*literal* units) on every job, their
values feeding the keys of the cells that read them; the training last. Each setup cell that ran is
kept as a :class:`KeptCell`: a key (its source and the literal values it reads), the local modules it
imported (and their files' digests), the names it bound, and the state of the process right after it
(random generators, torch's settings, folder, ``sys.path``, environment). The objects are kept by
:class:`~nbddp.rank_side.warm.kept_objects.KeptObjects`.

The next job keeps the setup cells up to the first one that **changed** (:meth:`WarmState.plan`: its
source, a value it reads, a module it imports from the notebook's folder), and every cell after that one
runs again. It keeps fewer when keeping would not be a fresh run: a later cell changed in place what an
earlier one made (the earlier one runs again), an object the setup made is gone (replaced by a later
cell), the last run changed something that can't be put back, or the setup holds something that can't
be kept at all (an open file). After every job the objects are put back as they were after setup
(:meth:`WarmState.after_job`), while the rank waits for the next job. The ranks agree on the cell to
start from (the earliest any of them needs), so a setup's collectives stay matched. Rank 0 says what
ran in one line: ``setup: cells 2–3 kept, cell 4 ran (edited)``.
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from nbddp.contracts.errors import NbddpError
from nbddp.rank_side.warm.kept_objects import KeptObjects, NotKept
from nbddp.rank_side.warm.object_state import ATOMIC, UNKEEPABLE
from nbddp.rank_side.warm.process_state import ProcessState
from nbddp.rank_side.warm.script_units import CELL, LITERAL, Unit, digest, file_digest, units_of
#: A name a kept cell bound whose object a later cell replaced: it was let go (the cell runs again if needed).
GONE = object()


@dataclass
class KeptCell:
    key: str
    name: str
    number: int | None
    text: str
    values: dict[str, str]
    """Digests of the literal values it read (a parameter, a kernel value)."""
    place: tuple[str, int]
    """The file and first line its code objects name (its functions keep them, in later jobs too)."""
    bound: dict[str, Any] = field(default_factory=dict)
    """The names it bound (:data:`GONE` once a later cell replaced the object), and those it deleted (``GONE``)."""
    deleted: frozenset[str] = frozenset()
    modules: dict[str, str] = field(default_factory=dict)
    """The local modules it imported: their files and the digests of their contents."""
    after: ProcessState | None = None
    """The process right after it: random generators, torch's settings, folder, ``sys.path``, environment changes."""


@dataclass
class Plan:
    """Where this job's setup starts: cells before :attr:`start` are kept, the others run; and why."""

    start: int
    cause: str = ""
    """The cell whose change makes the others run (``cell 4``)."""
    why: str = ""
    """What changed in it (``edited``, ``lr changed``, ``helper.py changed``), or, with :attr:`again`, why kept
    cells run again (``the last run changed X in place``)."""
    again: bool = False

    def earlier(self, start: int, clause: str) -> "Plan":
        """Start at ``start`` instead, because of ``clause`` (``cell 5 changes X in place, which cell 2 made``)."""
        if self.again or not self.why:
            return Plan(start, "", self.why or clause, again=True)
        return Plan(start, self.cause, f"{self.why}; {clause}")

class WarmState:
    """What one warm rank keeps of the setup between jobs (see the module's docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder).resolve()
        self.module: types.ModuleType | None = None
        self.objects: KeptObjects | None = None
        self.cells: list[KeptCell] = []
        self.bindings: dict[str, Any] = {}
        """The namespace after the last setup unit that ran (what the training started from)."""
        self.literal_objects: dict[str, tuple[str, Any]] = {}
        self.again: tuple[int, str] | None = None
        """What the last run changed that couldn't be put back: the cell to run again from, and why."""
        self.note = ""
        """Why the last setup wasn't kept ("" when it was, or there was none)."""
        self.libraries: dict[str, int] = {}
        """Names bound to what a cell imported from a library (not the notebook's folder), and the object's id:
        the library's state, never looked into nor put back."""
        self.unfinished: tuple[int, str] | None = None
        """The setup cell that raised or was interrupted in the last job, and its key."""
        self.starts: list[int] = []
        """Where this job's script has each setup cell (its first line): kept cells' tracebacks are moved there."""

    # ------------------------------------------------------------------ a job
    def run(self, script: Path, agree: Callable[[Plan], Plan], say: Callable[[str], None]) -> None:
        """Run the job's script: the setup cells that must run, then the training. Raises what the script raises."""
        units = units_of(script)
        if units is None:
            self.forget()
            import runpy

            runpy.run_path(str(script), run_name="__main__")
            return
        literal_values = self._literal_values(units)
        keys = self._keys(units, literal_values)
        try:
            plan = self.plan(units, keys, literal_values)
        except Exception as exc:  # noqa: BLE001 - nbddp's bookkeeping: it never costs the run, only what was kept
            self.forget()
            plan = Plan(0, "", f"nbddp could not use what it kept ({type(exc).__name__}: {exc})", again=True)
        plan = agree(plan)
        try:
            namespace = self._prepare(units, plan.start, literal_values, script)
        except BaseException as exc:
            self.forget()  # (the other ranks start where agreed: this rank can't start elsewhere on its own)
            if not isinstance(exc, Exception):
                raise
            raise NbddpError(f"this warm rank could not put back the setup it kept ({type(exc).__name__}: {exc}); "
                             "it dropped it: run the cell again") from exc
        cells = [u for u in units if u.kind == CELL]
        self.starts = [u.first_line for u in cells]
        finished = False
        try:
            self._setup(units, plan.start, keys, literal_values, namespace)
            finished = True
        finally:
            line = self._line(cells, plan, finished)
            if line:
                say(line)
        exec(units[-1].code, namespace)  # noqa: S102 - the training: the job's own code

    def _literal_values(self, units: list[Unit]) -> list[dict[str, Any]]:
        """Run nbddp's lines and the literal parameters once, in order (``_nbddp.start()`` among them): each
        literal unit's bindings."""
        scratch: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        values = []
        for unit in units:
            if unit.kind != LITERAL:
                values.append({})
                continue
            before = dict(scratch)
            exec(unit.code, scratch)  # noqa: S102 - nbddp's lines and the literal parameters, the job's own code
            values.append({k: v for k, v in scratch.items() if before.get(k, GONE) is not v and k != "__builtins__"})
        return values

    def _keys(self, units: list[Unit], literal_values: list[dict[str, Any]]) -> list[tuple[str, dict[str, str]]]:
        """Each setup cell's key, and the digests of the literal values it reads (by name)."""
        known: dict[str, str] = {}
        keys = []
        for unit, values in zip(units, literal_values):
            if unit.kind == LITERAL:
                known.update({name: digest(value) for name, value in values.items()})
            elif unit.kind == CELL:
                read = {name: known[name] for name in sorted(unit.reads) if name in known}
                keys.append((hashlib.sha256(repr((unit.text, sorted(read.items()))).encode()).hexdigest(), read))
        return keys

    def plan(self, units: list[Unit], keys: list[tuple[str, dict[str, str]]],
             literal_values: list[dict[str, Any]]) -> Plan:
        """The first setup cell this job runs, and why (before the ranks agree)."""
        cells = [u for u in units if u.kind == CELL]
        plan = Plan(len(cells))
        for index, (unit, (key, values)) in enumerate(zip(cells, keys)):
            if index >= len(self.cells):
                if self.unfinished is not None and self.unfinished[0] == index:  # it raised or was interrupted
                    why = "edited" if self.unfinished[1] != key else "it didn't finish last time"
                else:
                    why = "new" if self.cells else ""
                plan = Plan(index, unit.name, why)
                break
            kept = self.cells[index]
            stale = [Path(p).name for p, d in kept.modules.items() if file_digest(p) != d]
            if kept.key != key or stale:
                changed = [n for n in values if kept.values.get(n) != values[n]]
                why = ("edited" if kept.text != unit.text else f"{', '.join(changed)} changed" if changed
                       else f"{', '.join(stale)} changed")
                plan = Plan(index, unit.name, why)
                break
        if self.again is not None and self.again[0] <= plan.start:
            plan = Plan(self.again[0], "", self.again[1], again=True)
        return self._constrain(plan, cells)

    def _constrain(self, plan: Plan, cells: list[Unit]) -> Plan:
        """Start earlier where keeping the cells before ``plan.start`` would not give a fresh run's state: an
        object a kept cell made that a cell which runs changes in place, or that a later cell replaced (let go),
        or that can't be kept at all."""
        moved = True
        while moved and plan.start > 0 and self.objects is not None:
            moved = False
            for record in self.objects.records.values():
                if record.birth < plan.start and record.kind == UNKEEPABLE:
                    plan, moved = plan.earlier(record.birth, f"{record.name()} ({record.why}) can't be kept"), True
                elif record.birth < plan.start <= record.changed:
                    clause = (f"{self._name(cells, record.changed)} changes {record.name()} in place, "
                              f"which {self._name(cells, record.birth)} made")
                    plan, moved = plan.earlier(record.birth, clause), True
                if moved:
                    break
            for index in range(plan.start if not moved else 0):
                later = self.cells[index + 1:plan.start]
                gone = [name for name, value in self.cells[index].bound.items()
                        if value is GONE and not any(name in c.bound for c in later)]
                if gone:
                    clause = f"a later cell replaced {gone[0]}, which {self._name(cells, index)} made"
                    plan, moved = plan.earlier(index, clause), True
                    break
        return plan

    def _name(self, cells: list[Unit], index: int) -> str:
        if index < len(cells):
            return cells[index].name
        return self.cells[index].name if index < len(self.cells) else f"cell #{index + 1}"

    # ------------------------------------------------------------------ keep what can be kept, drop the rest
    def _prepare(self, units: list[Unit], start: int, literal_values: list[dict[str, Any]], script: Path) -> dict:
        """The namespace the job starts in: the kept cells' names (their objects as they were after them)
        and this job's literal values, the process's state as after the last kept cell."""
        if start == 0 or self.module is None:
            self.forget(collect=self.module is not None)
            self.module = types.ModuleType("__main__")
            self.objects = KeptObjects(self.module.__dict__, self.folder)
        else:
            self._cut(start)
        namespace = self.module.__dict__
        kept = dict(self._replay(units, start, literal_values))
        namespace.clear()
        namespace.update({"__name__": "__main__", "__file__": str(script), "__doc__": None, "__package__": None,
                          "__spec__": None, "__loader__": None, "__builtins__": __builtins__}, **kept)
        sys.modules["__main__"] = self.module
        sys.argv[:1] = [str(script)]
        if start:
            _restore_process(self.cells[start - 1].after, self.cells[:start])
        self.bindings = dict(namespace)
        return namespace

    def _replay(self, units: list[Unit], start: int, literal_values: list[dict[str, Any]]) -> dict[str, Any]:
        """The names as they were after cell ``start - 1``: this job's literal values where a literal unit bound
        them last (the kept object where the value didn't change), else the kept cell's."""
        names: dict[str, Any] = {}
        cell = 0
        for unit, values in zip(units, literal_values):
            if unit.kind == CELL:
                if cell >= start:
                    break
                kept = self.cells[cell]
                for name in kept.deleted:
                    names.pop(name, None)
                names.update(kept.bound)
                cell += 1
            elif unit.kind == LITERAL:
                for name, value in values.items():
                    old = self.literal_objects.get(name)
                    reuse = (old is not None and old[0] == digest(value) and self.objects is not None
                             and id(old[1]) in self.objects.records)
                    names[name] = old[1] if reuse else value
                    if self.objects is not None and self.objects.kind(value) != ATOMIC:
                        self.literal_objects[name] = (digest(value), names[name])
        return {k: v for k, v in names.items() if v is not GONE}

    def _cut(self, start: int) -> None:
        """Let go of cells ``start`` on: their objects, and the local modules they imported."""
        dropped = self.cells[start:]
        self.cells = self.cells[:start]
        if self.objects is not None and dropped:
            self.objects.drop_from(start)
        _forget_modules({p for c in dropped for p in c.modules})
        if dropped:
            self.bindings = {}
            if self.module is not None:
                self.module.__dict__.clear()
            _collect()

    def forget(self, collect: bool = True) -> None:
        """Keep nothing (``%ddp_ranks forget``, a script that isn't nbddp's, a setup that couldn't be kept)."""
        _forget_modules({p for c in self.cells for p in c.modules})
        if self.module is not None:
            self.module.__dict__.clear()
        self.module, self.objects, self.cells, self.bindings = None, None, [], {}
        self.literal_objects, self.again, self.libraries, self.unfinished = {}, None, {}, None
        if collect:
            _collect()

    # ------------------------------------------------------------------ running the setup
    def _setup(self, units: list[Unit], start: int, keys: list[tuple[str, dict[str, str]]],
               literal_values: list[dict[str, Any]], namespace: dict) -> None:
        """Run the setup cells from ``start`` on (and this job's literal units after them), recording each."""
        cell, ran = 0, False
        self.note, self.again = "", None
        for unit, values in zip(units[:-1], literal_values):
            if unit.kind == CELL:
                if cell >= start:
                    self.unfinished = (cell, keys[cell][0])  # until it ends: the next job says why it runs
                    self._run_cell(unit, cell, keys[cell], namespace)
                    self.unfinished, ran = None, True
                cell += 1
            elif cell > start:  # (up to cell ``start``, the replay bound them)
                namespace.update(values)
                self.literal_objects.update({n: (digest(v), v) for n, v in values.items()
                                             if self.objects is not None and self.objects.kind(v) != ATOMIC})
        if ran and self.objects is not None and not self.note:
            try:
                self.objects.seal(cell - 1)
            except NotKept as exc:
                self.note = str(exc)
            except Exception as exc:  # noqa: BLE001 - nbddp's bookkeeping never costs the run: it keeps nothing
                self.note = f"nbddp could not keep it ({type(exc).__name__}: {exc})"
        self.bindings = dict(namespace)

    def _run_cell(self, unit: Unit, index: int, key: tuple[str, dict[str, str]], namespace: dict) -> None:
        before, environ, modules = dict(namespace), dict(os.environ), set(sys.modules)
        exec(unit.code, namespace)  # noqa: S102 - the setup cell, the job's own code
        try:
            self._record_cell(unit, index, key, namespace, before, environ, modules)
        except NotKept as exc:
            self.note = str(exc)
        except Exception as exc:  # noqa: BLE001 - nbddp's bookkeeping never costs the run: it keeps nothing
            self.note = f"nbddp could not keep it ({type(exc).__name__}: {exc})"

    def _record_cell(self, unit: Unit, index: int, key: tuple[str, dict[str, str]], namespace: dict,
                     before: dict, environ: dict[str, str], modules: set[str]) -> None:
        """Keep what setup cell ``index`` did: the names it bound, the local modules it imported, the process's
        state after it, the objects it made or changed."""
        bound = {k: v for k, v in namespace.items() if before.get(k, GONE) is not v and not _dunder(k)}
        deleted = frozenset(k for k in before if k not in namespace and not _dunder(k))
        kept = KeptCell(key[0], unit.name, unit.number, unit.text, key[1], (unit.code.co_filename, unit.first_line),
                        bound, deleted, self._local_modules(modules),
                        ProcessState.capture(since=environ, generators=True))
        self.cells.append(kept)
        self.bindings = dict(namespace)
        for name, module in unit.imports:
            source = getattr(sys.modules.get(module), "__file__", None)
            if name in namespace and not (source and _inside(Path(source), self.folder)):
                self.libraries[name] = id(namespace[name])
        if self.objects is None or self.note:
            return
        libraries = frozenset(n for n, i in self.libraries.items() if id(namespace.get(n)) == i)
        seen = self.objects.walk(index, libraries) | set(self.libraries.values())
        for earlier in self.cells:  # an object a later cell replaced is let go, as a fresh run lets it go
            for name, value in earlier.bound.items():
                if value is not GONE and id(value) not in seen and self.objects.kind(value) != ATOMIC:
                    earlier.bound[name] = GONE

    def _local_modules(self, before: set[str]) -> dict[str, str]:
        found = {}
        for name in set(sys.modules) - before:
            path = getattr(sys.modules.get(name), "__file__", None)
            if path and _inside(Path(path), self.folder):
                found[str(Path(path).resolve())] = file_digest(path)
        return found

    def local_modules(self) -> set[str]:
        """The files of the local modules kept cells imported (they stay imported between jobs)."""
        return {p for c in self.cells for p in c.modules}

    # ------------------------------------------------------------------ after a job
    def after_job(self) -> None:
        """Put the kept objects back as they were after setup, while the rank waits for the next job; what
        can't be put back makes its cell run again next time (and is let go now)."""
        if self.module is None:
            return
        if self.note:  # the setup couldn't be kept: the next job runs it from the start
            self.forget(collect=False)  # (the rank collects after every job)
            return
        namespace = self.module.__dict__
        namespace.clear()
        namespace.update(self.bindings)
        problems = self.objects.restore() if self.objects is not None else []
        if problems:
            first, why = min(problems, key=lambda problem: problem[0].birth)
            self.again = (first.birth, why)
            self._cut(first.birth)

    def report(self) -> dict[str, Any]:
        """What ``%ddp_ranks`` shows of this rank's kept state."""
        if self.module is None or not self.cells:
            return {"cells": [], "names": [], "copies": 0, "note": self.note}
        sizes, copies = self.objects.sizes() if self.objects is not None else ([], 0)
        sized = {name for name, _, _ in sizes}
        names = [name for name, value in self.bindings.items() if not _dunder(name) and name not in sized
                 and not isinstance(value, (types.ModuleType, types.FunctionType, type))]
        return {"cells": [c.name for c in self.cells], "names": [list(s) for s in sizes] + [[n, 0, 0] for n in names],
                "copies": copies, "note": self.note}

    # ------------------------------------------------------------------ tracebacks
    def relocate(self, filename: str, line: int, script: str) -> tuple[str, int]:
        """Where a line of a kept cell's code (compiled in an earlier job's script, whose line numbers its
        functions keep) is in this job's script."""
        for kept, start in zip(self.cells, self.starts):
            old_file, old_start = kept.place
            if filename == old_file and old_start <= line < old_start + kept.text.count("\n") + 1:
                return script, start + line - old_start
        return filename, line

    def _line(self, cells: list[Unit], plan: Plan, finished: bool = True) -> str:
        """The one line saying what ran: ``setup: cells 2–3 kept, cell 4 ran (edited)`` (a setup cell that raised
        says so itself, in its traceback, after the line)."""
        if not cells:
            return ""
        kept, ran = cells[:plan.start], cells[plan.start:]
        parts = [f"{_cells(kept)} kept"] if kept else []
        if ran:
            if plan.again:
                parts.append(f"{_cells(ran)} ran again: {plan.why}")
            elif plan.why:
                alone = len(ran) == 1 and ran[0].name == plan.cause
                parts.append(f"{_cells(ran)} ran ({plan.why if alone else f'{plan.cause} {plan.why}'})")
            else:
                parts.append(f"{_cells(ran)} ran")
        line = "setup: " + ", ".join(parts)
        if self.note:
            line += f"; not kept: {self.note}"
        elif ran and not kept and not plan.why and finished:
            line += "; kept for the next run"
        return line


def _cells(units: list[Unit]) -> str:
    """``cell 4``, ``cells 2–3``, ``cells 2, 5``, ``In [3], In [5]``."""
    numbers = [u.number for u in units]
    if any(u.name != f"cell {u.number}" for u in units) or None in numbers:
        return ", ".join(u.name for u in units)
    if len(numbers) == 1:
        return f"cell {numbers[0]}"
    if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
        return f"cells {numbers[0]}–{numbers[-1]}"
    return "cells " + ", ".join(map(str, numbers))


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _inside(path: Path, folder: Path) -> bool:
    resolved = path.resolve()
    return resolved.is_relative_to(folder) and not {"site-packages", "dist-packages"} & set(resolved.parts)


def _forget_modules(paths: set[str]) -> None:
    if not paths:
        return
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and str(Path(path).resolve()) in paths:
            del sys.modules[name]


def _collect() -> None:
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _restore_process(state: ProcessState, cells: list[KeptCell]) -> None:
    """The process as after the last of ``cells``: its generators, torch's settings, folder and ``sys.path``; the
    environment changes of every one of them, on top of this job's own environment."""
    for cell in cells:
        if cell.after is not None:
            cell.after.apply_environ()
    state.restore(environ=False)
