"""A rank's log stays within its cap (``--log-cap``, 100 MB by default) however much the training prints.

A rank's stdout and stderr are its file descriptors 1 and 2, pointed at ``logs/rank-N.log``
(:func:`nbddp.rank_side.process.log_to_run_dir`): C code's output lands there too, and a flood can never
block the rank on a full pipe. So the cap is kept beside the writes, not in their way: a daemon thread looks
at the file's size :data:`CHECKS_PER_SECOND` times a second. Past the cap it cuts the file back to the cap, the
head's last bytes replaced by one line saying so; from then on it lets the file grow by at most :data:`TAIL`
beyond that line and cuts it back to it, all but its newest quarter, written back after the line (what the
rank writes between that read and the cut, a few microseconds' worth, is dropped). Both are written at their
offsets, not appended: the rank goes on writing meanwhile. The file therefore holds the first ``cap`` bytes
(the line last), and the last lines the rank wrote (a traceback at the end among them; the exception is
also in ``errors/rank-N.json``), and the disk holds at most ``cap + TAIL`` of it (and what a quarter second
adds), whatever a forgotten detached run prints for a week.

``ranks/log-N.json`` (:meth:`nbddp.contracts.rundir.RunDir.rank_log_cap`) says where the kept head ends and about
how much was dropped (bytes written between the size check and the cut are dropped uncounted): the follower
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
        if log.kept is None and length > log.cap:
            line = (f"\n[nbddp] this log reached its cap of {size(log.cap)} (--log-cap): from here on only "
                    "the rank's last lines are kept, below.\n").encode()
            os.ftruncate(1, log.cap)
            _write_at(log.cap - len(line), line)  # the head's last bytes: the rank may be appending already
            log.kept, log.dropped = log.cap, length - log.cap
        elif log.kept is not None and length > log.kept + TAIL:
            newest = _newest_lines(length, min(TAIL // 4, length - log.kept))
            _write_at(log.kept, newest)  # what was just written stays: a rank that ends now keeps its last lines
            os.ftruncate(1, log.kept + len(newest))
            log.dropped += length - log.kept - len(newest)
        else:
            return
        write_json(log.report, {"cap": log.cap, "kept": log.kept, "dropped": log.dropped})
    except OSError:
        pass  # a log that can't be looked at or cut is left as it is


def _write_at(offset: int, data: bytes) -> None:
    """``data`` at ``offset`` of the log, whatever the rank appends meanwhile. Not through fd 1: it appends
    (O_APPEND, so that every write of the rank's lands at the end), and Linux's ``pwrite`` on such a descriptor
    appends too: bytes the rank wrote between a cut and this write would come before ``data``."""
    fd = os.open("/proc/self/fd/1", os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _newest_lines(length: int, most: int) -> bytes:
    """The log's last whole lines, ``most`` bytes at most (read through ``/proc``: fd 1 is write-only)."""
    try:
        with open("/proc/self/fd/1", "rb") as log:
            log.seek(length - most)
            data = log.read(most)
    except OSError:
        return b""
    return data[data.find(b"\n") + 1:] if b"\n" in data else b""


def _inode() -> tuple[int, int]:
    info = os.fstat(1)
    return info.st_dev, info.st_ino
