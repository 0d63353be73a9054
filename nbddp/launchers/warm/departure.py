"""How the ranks of a stopped warm job leave it, and when they can't: the kernel's side.

A warm job is stopped (Ctrl-C, a time limit, a failed rank) by marking it ``stopped`` and sending
SIGINT to every rank still in it (:meth:`nbddp.launchers.warm.pool.WarmPool.interrupt`). The ranks are
kept for the next run whenever they can leave, and "can" must not mean "within a fixed time": on a
loaded machine a rank may take the job only after the interrupt (it then ends it without running it),
may wait in a collective for a peer that is slow to free its process group, or may take seconds to
clean up. So the ranks are judged by **progress**, not by a clock (:class:`Departure`):

* a rank that hasn't taken the job will end it the moment it does (the ``stopped`` mark): it is
  not waited for, unless a rank in the job may be waiting for it;
* a rank in the job that heard the interrupt (its SIGINT handler ran: it is in Python, on its way
  out) or that is paused (SIGSTOP, a debugger) is responsive: it is waited for, up to
  :data:`LEAVE_SECONDS`;
* otherwise the ranks still leaving must show progress: CPU time spent, or another rank heard the
  interrupt, ended the job or freed its group. After :data:`SETTLE_SECONDS` without any, they are
  stuck (a rank blocked in C code where no interrupt reaches it, and its peers waiting for it).
* CPU time is no progress from a rank that took the job and hasn't heard the interrupt unless its
  Python stack moved between two dumps :data:`SAMPLE_SECONDS` apart: such a rank is inside one native
  call (hearing is a Python handler, run between bytecodes), and spinning there is no sign of leaving:
  a rank in CUDA's ``cudaDeviceSynchronize`` spins on the CPU for a kernel that may never end. A rank
  whose library took SIGINT over runs Python, so its stack moves. Only such ranks are sampled; a rank
  that heard the interrupt is left alone. A native call still running 3 s after Stop costs the warm
  ranks, not the user's wait (it was up to :data:`LEAVE_SECONDS`).

A rank that can't leave is named with where it was: its Python stack, which it writes on SIGUSR1
(:mod:`faulthandler`, see :mod:`nbddp.rank_side.warm.loop`), translated to the notebook's cell and line.
Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Protocol

import psutil

from nbddp.contracts.atomic import read_json
from nbddp.contracts.devices import Devices
from nbddp.contracts.pool_dir import JobEnd, PoolDir
from nbddp.contracts.sourcemap import SourceMap, sourcemap_path


class DepartingPool(Protocol):
    """What a departure reads of the pool its ranks belong to (:class:`~nbddp.launchers.warm.pool.WarmPool`)."""

    dir: PoolDir
    devices: Devices

    def alive(self) -> bool: ...

    def rank_pids(self) -> dict[int, int]: ...

#: How long the ranks still leaving a stopped job may go without any sign of progress before they are
#: stuck (the pool is then stopped and, for ``%%ddp_train``, replaced at once).
SETTLE_SECONDS = 3.0
#: The most the ranks may take to leave a stopped job, however responsive they are (a job that catches
#: the interrupt and keeps working).
LEAVE_SECONDS = 30.0
#: CPU time that counts as progress. A rank blocked in a gloo collective spends about 3 ms a second
#: (measured: its memory thread); a rank that works gets its share of a core, 200 ms a second even with
#: 10 busy processes on 2 cores.
CPU_PROGRESS = 0.05
#: How long a rank gets to write its stacks once asked.
STACK_SECONDS = 2.0
#: How often a rank spending CPU time without having heard the interrupt has its stack looked at (did it move?).
SAMPLE_SECONDS = 0.5


class Departure:
    """The ranks of job ``number`` of ``pool`` leaving it, once it was stopped; :meth:`check` says how it goes."""

    def __init__(self, pool: DepartingPool, number: int) -> None:
        self.pool, self.number = pool, number
        self.started = self.progressed = time.monotonic()
        self._cpu: dict[int, float] = {}
        self._samples: dict[int, tuple[float, list[list]]] = {}
        self._deaf: set[int] = set()
        self._events = -1

    def check(self) -> str | None:
        """``None``: the ranks are still leaving; ``""``: every rank left the job or hasn't taken it (it ends
        it the moment it does); else why they can't be kept, naming each rank and where it was."""
        states = self.states()
        if all(state == "out" for state in states.values()):
            return ""
        if not self.pool.alive():
            return "its ranks had exited"
        if not any(state in ("in", "releasing") for state in states.values()):
            return ""
        now = time.monotonic()
        if self._progress(states) or self._responsive(states):  # (the stall is counted from the last of either)
            self.progressed = now
        if now - self.started > LEAVE_SECONDS:
            return self._name(states, f"was still leaving the job after {LEAVE_SECONDS:.0f}s")
        if now - self.progressed > SETTLE_SECONDS:
            return self._name(states, "couldn't leave the job")
        return None

    def wait(self, poll: float = 0.02) -> str:
        """:meth:`check` until it has an answer."""
        while (why := self.check()) is None:
            time.sleep(poll)
        return why

    def states(self) -> dict[int, str]:
        """Each rank: ``out`` (ended the job, and freed its group if it went wrong), ``releasing`` (ended it,
        freeing its group), ``in`` (took the job, still in it) or ``pending`` (hasn't taken it)."""
        directory, found = self.pool.dir, {}
        for rank in range(self.pool.devices.nproc):
            ending = _json(directory.job_exit(self.number, rank))
            if ending is not None:
                done = ending.get("status") == JobEnd.OK or directory.released(self.number, rank).exists()
                found[rank] = "out" if done else "releasing"
            else:
                found[rank] = "in" if directory.taken(self.number, rank).exists() else "pending"
        return found

    def _heard(self, rank: int) -> dict | None:
        return _json(self.pool.dir.heard(self.number, rank))

    def _progress(self, states: dict[int, str]) -> bool:
        """Anything moved since the last look: a rank heard the interrupt, ended the job or freed its group,
        or one still leaving spent :data:`CPU_PROGRESS` of CPU time."""
        directory = self.pool.dir
        events = sum((state in ("out", "releasing")) + directory.heard(self.number, rank).exists()
                     + directory.released(self.number, rank).exists() for rank, state in states.items())
        moved, self._events = events != self._events, events
        pids = self.pool.rank_pids()
        for rank, state in states.items():
            if state == "out" or rank not in pids:
                continue
            try:
                times = psutil.Process(pids[rank]).cpu_times()
            except psutil.Error:
                continue
            spent = times.user + times.system
            if spent >= self._cpu.setdefault(rank, spent) + CPU_PROGRESS:
                self._cpu[rank] = spent
                native = state == "in" and self._heard(rank) is None  # (in one native call, or its library's SIGINT)
                moved = moved or not native or self._stack_moved(rank)
        return moved

    def _stack_moved(self, rank: int) -> bool:
        """The rank's Python stack differs from its last dump, taken :data:`SAMPLE_SECONDS` or more ago (a dump is
        asked of it at most that often; the first is only a baseline): a rank spinning in one native call stays put.
        A rank that writes no dump (its SIGUSR1 taken over) can't be told apart: its CPU time counts, as it did."""
        if rank in self._deaf:
            return True
        now = time.monotonic()
        last = self._samples.get(rank)
        if last is not None and now - last[0] < SAMPLE_SECONDS:
            return False
        frames = self._stacks([rank]).get(rank)
        if frames is None:
            self._deaf.add(rank)
            return True
        self._samples[rank] = (now, frames)
        return last is not None and frames != last[1]

    def _responsive(self, states: dict[int, str]) -> bool:
        """A rank still leaving heard the interrupt (it runs Python, on its way out), or is paused (SIGSTOP,
        a debugger: alive, and it goes on when continued): waiting for it is not waiting for nothing."""
        pids = self.pool.rank_pids()
        for rank, state in states.items():
            if state == "out":
                continue
            if state == "in" and self._heard(rank) is not None:
                return True
            try:
                if pids.get(rank) and psutil.Process(pids[rank]).status() in (psutil.STATUS_STOPPED,
                                                                               psutil.STATUS_TRACING_STOP):
                    return True
            except psutil.Error:
                continue
        return False

    def _name(self, states: dict[int, str], what: str) -> str:
        """``rank 1 couldn't leave the job: at the %%ddp_train cell, line 4``, for each rank still in it; each
        one's stack goes to its log in the run dir too (the view shows it)."""
        job = _json(self.pool.dir.job(self.number)) or {}
        script = job.get("script", "")
        stacks = self._stacks([rank for rank, state in states.items() if state != "out"])
        said = []
        for rank, state in states.items():
            if state == "out":
                continue
            frames = stacks.get(rank) or (self._heard(rank) or {}).get("frames") or []
            doing = {"pending": "hadn't taken the job", "releasing": "ended the job but couldn't free its process group"
                     }.get(state, what)
            place = where(frames, script)
            said.append(f"rank {rank} {doing}" + (f": {place}" if place else ""))
            _to_run_log(job, rank, f"rank {rank} {doing} after the interrupt", frames)
        return "; ".join(said)

    def _stacks(self, ranks: list[int]) -> dict[int, list[list]]:
        """Each of ``ranks``' main thread's Python frames, outermost first, as it writes them on SIGUSR1."""
        pids, sizes = self.pool.rank_pids(), {}
        for rank in ranks:
            sizes[rank] = _size(self.pool.dir.stack(rank))
            if rank in pids:
                try:
                    os.kill(pids[rank], signal.SIGUSR1)
                except OSError:
                    pass
        found: dict[int, list[list]] = {}
        deadline = time.monotonic() + STACK_SECONDS
        while len(found) < len(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
            for rank in ranks:
                size = _size(self.pool.dir.stack(rank))
                if rank not in found and size > sizes[rank]:
                    time.sleep(0.05)  # grown: written in a burst of writes, so read it once it stops growing
                    if _size(self.pool.dir.stack(rank)) == size:
                        found[rank] = main_thread_frames(self.pool.dir.stack(rank).read_text(errors="replace"))
        return found


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _json(path: Path) -> dict | None:
    data = read_json(path)
    return data if isinstance(data, dict) else None


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def _to_run_log(job: dict, rank: int, what: str, frames: list[list]) -> None:
    """Append where the rank was to its log in the job's run dir, as a traceback (script lines named as cells)."""
    from nbddp.contracts.rank_env import RankEnv

    run_dir = RankEnv.from_environ(job.get("env") or {}).run_dir
    if run_dir is None or not frames:
        return
    script = job.get("script", "")
    first = next((i for i, frame in enumerate(frames) if script and _same_file(frame[0], script)), 0)
    lines = [f"[nbddp] {what}; where it was (most recent call last):"]  # (from the script on, as a traceback)
    lines += [f'  File "{file}", line {line}, in {name}' for file, line, name in frames[first:]]
    text = "\n".join(lines) + "\n"
    try:
        text = SourceMap.load(sourcemap_path(script)).translate_traceback(text)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        with open(run_dir.rank_log(rank), "a", encoding="utf-8") as log:
            log.write(text)
    except OSError:
        pass


def main_thread_frames(text: str) -> list[list]:
    """The main thread's frames, outermost first, from the last :mod:`faulthandler` dump in ``text`` (whose first
    line, ``main thread 0x…``, names the main thread: the dump may have been written by another thread)."""
    first, _, dumps = text.partition("\n")
    main = first.rpartition(" ")[2]
    frames: list[list] = []
    current: list[list] | None = None
    for line in dumps.splitlines():
        thread = _THREAD.match(line)
        if thread:
            current = [] if thread.group(1) == main else None
            if current is not None:
                frames = current  # (the last dump wins)
        elif current is not None and (frame := _FRAME.match(line)):
            current.append([frame.group(1), int(frame.group(2)), frame.group(3)])
    return frames[::-1]


def where(frames: list[list], script: str) -> str:
    """Where a rank was, from its Python frames (outermost first): ``at the %%ddp_train cell, line 4``, or ``in
    all_reduce at distributed_c10d.py:2950, from the %%ddp_train cell, line 5``; ``""`` without frames.

    Lines of the job's script are named as the notebook's cells (the script's source map)."""
    if not frames:
        return ""
    inner = frames[-1]
    mine = [frame for frame in frames if script and _same_file(frame[0], script)]
    here = f"in {inner[2]} at {Path(inner[0]).name}:{inner[1]}"
    if not mine:
        return here
    cell = _cell_line(script, int(mine[-1][1]))
    return f"at {cell}" if mine[-1] is inner else f"{here}, from {cell}"


def _same_file(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _cell_line(script: str, line: int) -> str:
    try:
        found = SourceMap.load(sourcemap_path(script)).where(line)
    except (OSError, ValueError, KeyError, TypeError):
        found = None
    return found or f"{Path(script).name}, line {line}"
