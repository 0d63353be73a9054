"""A rank's log stays within its cap (``--log-cap``, 100 MB by default) however much the training prints.

A rank's stdout and stderr are its file descriptors 1 and 2, pointed at ``logs/rank-N.log``
(:func:`nbddp.rank_side.process.log_to_run_dir`): C code's output lands there too, and a flood can never
block the rank on a full pipe. So the cap is kept beside the writes, not in their way: a daemon thread looks
at the file's size :data:`CHECKS_PER_SECOND` times a second. Past the cap it replaces the head's last bytes with
one line saying so; from then on it lets the file grow by at most :data:`TAIL` beyond that line and cuts it back
to it, all but its newest quarter, moved to after the line with what the rank appended during the move (copied
again until the size holds still: only a write landing in the microseconds between that look and the cut is
dropped). Both are written at their offsets, not appended: the rank goes on writing meanwhile. The file therefore
holds the first ``cap`` bytes (the line last), and the last lines the rank wrote (a traceback at the end among
them; the exception is also in ``errors/rank-N.json``), and the disk holds at most ``cap + TAIL`` of it (and
what a quarter second adds), whatever a forgotten detached run prints for a week.

``ranks/log-N.json`` (:meth:`nbddp.contracts.rundir.RunDir.rank_log_cap`) says where the kept head ends and about
how much was dropped (a write landing between the last look and the cut is dropped uncounted): the follower
(:mod:`nbddp.job.follow`) streams the head and, once the rank has ended, the tail, and ``result.json`` and
the ending line say what was dropped. A warm rank's log changes with each job: the count starts again.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from nbddp.contracts.atomic import write_json
from nbddp.contracts.rank_memory import size

CHECKS_PER_SECOND = 4
#: Rounds of copying what the rank appended during a cut, before it is cut anyway (a rank out-writing the copy).
COPY_ROUNDS = 8
#: What the log keeps of the output after the cap: its latest bytes, up to this many.
TAIL = 1 << 20


@dataclass
class _Capped:
    """The log fd 1 points at now, and what was cut from it."""

    cap: int
    report: Path
    inode: tuple[int, int]
    kept: int | None = None
    """Where the head and the cap's line end (``None``: the cap wasn't reached)."""
    dropped: int = 0


_current: _Capped | None = None
_lock = threading.Lock()
_thread: threading.Thread | None = None


def watch(cap: int | None, report: Path | None) -> None:
    """Keep the log that fd 1 points at now within ``cap`` bytes, saying what was dropped in ``report``
    (``None``: don't watch, e.g. output that isn't a rank log)."""
    global _current, _thread
    with _lock:
        _current = None if not cap or report is None else _Capped(cap, report, _inode())
        if _current is not None and _thread is None:
            _thread = threading.Thread(target=_keep_within, name="nbddp-log-cap", daemon=True)
            _thread.start()


def _keep_within() -> None:
    stop = threading.Event()
    while not stop.wait(1 / CHECKS_PER_SECOND):
        with _lock:
            if _current is not None:
                _check(_current)


def _check(log: _Capped) -> None:
    try:
        length = os.fstat(1).st_size
        if _inode() != log.inode:
            return  # fd 1 was pointed elsewhere without a new watch(): not this log any more
        said = log.kept, log.dropped
        if log.kept is None and length > log.cap:
            line = (f"\n[nbddp] this log reached its cap of {size(log.cap)} (--log-cap): from here on only "
                    "the rank's last lines are kept, below.\n").encode()
            _write_at(log.cap - len(line), line)  # the head's last bytes; what the rank wrote past them is the tail
            log.kept, log.dropped = log.cap, len(line)
        if log.kept is not None and length > log.kept + TAIL:
            log.dropped += _keep_newest(log.kept, length, min(TAIL // 4, length - log.kept))
        if (log.kept, log.dropped) != said:
            write_json(log.report, {"cap": log.cap, "kept": log.kept, "dropped": log.dropped})
    except OSError:
        pass  # a log that can't be looked at or cut is left as it is


def _write_at(offset: int, data: bytes) -> None:
    """``data`` at ``offset`` of the log, whatever the rank appends meanwhile."""
    fd = _log_at_offsets()
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _keep_newest(kept: int, length: int, most: int) -> int:
    """Move the log's newest whole lines (``most`` bytes at most, up to ``length``) to ``kept``, then what the rank
    appended while they were moved, and cut the file after them; the bytes dropped. Where no line ends in them
    (a progress bar redrawn with ``\\r``), from the first redraw that begins in them, else the last ``most`` bytes
    as they are: the log is cut all the same.

    Cutting at ``length`` itself would drop what the rank wrote during the copy (its very last line, when it ends
    then); copying again until the size holds still leaves only the microseconds between that look and the cut."""
    fd = _log_at_offsets()
    try:
        newest = os.pread(fd, most, length - most)
        start = newest.find(b"\n") + 1 or newest.find(b"\r") + 1
        source, target, end = length - most + start, kept, length
        for _ in range(COPY_ROUNDS):
            while source < end:
                data = os.pread(fd, min(end - source, TAIL), source)
                if not data:
                    break
                os.pwrite(fd, data, target)
                source, target = source + len(data), target + len(data)
            end = os.fstat(fd).st_size
            if end <= source:
                break
        os.ftruncate(fd, target)
        return max(end, source) - target
    finally:
        os.close(fd)


def _log_at_offsets() -> int:
    """The log again, read and written at offsets. Not through fd 1: it appends (O_APPEND, so that every write
    of the rank's lands at the end), and Linux's ``pwrite`` on such a descriptor appends too: bytes the rank wrote
    between a cut and a write would come before it. (fd 1 is write-only as well.)"""
    return os.open("/proc/self/fd/1", os.O_RDWR)


def _inode() -> tuple[int, int]:
    info = os.fstat(1)
    return info.st_dev, info.st_ino
