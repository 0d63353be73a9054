"""Follow a running job's files and turn them into events for the sinks.

Ranks write ``logs/rank-N.log`` and rank 0 writes ``metrics.jsonl``; the
launcher's own output (torchrun, or the Catalyst parent) goes to
``logs/launcher.log``. Following files rather than pipes means a rank that
floods its output never blocks, and nothing is lost if the viewer is slow.
Bytes are split on newlines *before* decoding (a UTF-8 character is never cut
in two), undecodable bytes are replaced, and a carriage-return progress bar is
reduced to what a terminal would show; a line another writer glued to a bar's state (a warning
from torch's C++ code, printed while tqdm's bar held the line) is a line of its own. Each rank's peak memory
(``ranks/memory-N.json``) is read once a second and told when it grew.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Union

from nbddp.contracts.atomic import read_json
from nbddp.contracts.rank_memory import read_peaks, size
from nbddp.contracts.rundir import RunDir

_RANK_LOG = re.compile(r"rank-(\d+)\.log$")
#: A tqdm bar's state, up to the end of its timing bracket (``| 1/3 [00:01<00:02, 3.4it/s, loss=0.3]``), then what
#: was written after it before any newline (tqdm leaves the line open while it redraws), less tqdm's padding.
_GLUED_TO_BAR = re.compile(rb"^(.*?\[(?:\d+:)?\d+:\d\d(?:<(?:(?:\d+:)?\d+:\d\d|\?))?, [^\]]*\]) *(\S.*)$", re.S)


@dataclass(frozen=True)
class LogLine:
    """One line of output. ``rank`` is ``None`` for the launcher process itself."""

    rank: int | None
    text: str
    progress: bool = False
    """True for the current state of a ``\\r`` progress bar (more will replace it)."""
    every_rank: bool = False
    """The same line came from every rank (shown once, as ``[all ranks]``)."""


@dataclass(frozen=True)
class MetricsEvent:
    """One ``nbddp.log(**metrics)`` record from rank 0."""

    values: dict


@dataclass(frozen=True)
class MemoryEvent:
    """Every rank's peak memory so far (``{rank: bytes}``), when it grew (:mod:`nbddp.contracts.rank_memory`)."""

    peaks: dict


Event = Union[LogLine, MetricsEvent, MemoryEvent]
#: How often the ranks' memory reports are read (they are written at most once a second).
MEMORY_SECONDS = 1.0
Sink = Callable[[Event], None]


#: How much of one file a poll reads at most: a rank flooding its log never holds up the loop that follows
#: the job (its time limits, an interrupt, a view's clock), and what wasn't read yet is read on the next polls.
READ_BYTES = 1 << 18
#: What the last read of a file (the job has ended, or was stopped) shows at most: its last bytes, after a line
#: saying how much is only in the log, so that a stop under a flood of output ends in a moment, not minutes.
LAST_READ_BYTES = 1 << 18


@dataclass
class Followed:
    """A file being followed: how far it was read, and the unterminated line read so far."""

    path: Path
    rank: int | None
    offset: int = 0
    partial: bytes = b""
    shown_progress: bytes = field(default=b"")
    kept: int | None = None
    """A rank log that reached ``--log-cap``: where its kept start ends (the rest is its last lines, read once
    the rank has ended: :mod:`nbddp.rank_side.log_cap` cuts them back while it runs)."""


class RunFollower:
    """Reads what was appended to a run dir's log and metrics files since the last poll."""

    def __init__(self, run_dir: RunDir, include_launcher: bool = True) -> None:
        self.run_dir = run_dir
        self.include_launcher = include_launcher
        self._files: dict[Path, Followed] = {}
        self._metrics = Followed(run_dir.metrics, None)
        self._peaks: dict[int, int] = {}
        self._peaks_read = 0.0

    def poll(self, final: bool = False) -> Iterator[Event]:
        """New events since the last call; ``final`` flushes unterminated lines too."""
        for followed in self._discover():
            yield from self._read_lines(followed, final)
        for raw in read_complete(self._metrics, final):
            try:
                values = json.loads(raw)
            except ValueError:
                continue
            if isinstance(values, dict):
                yield MetricsEvent(values)
        now = time.monotonic()
        if final or now - self._peaks_read >= MEMORY_SECONDS:
            self._peaks_read = now
            peaks = read_peaks(self.run_dir)
            if peaks != self._peaks:
                self._peaks = peaks
                yield MemoryEvent(peaks)

    def _discover(self) -> list[Followed]:
        paths = self.run_dir
        logs = paths.logs
        if logs.is_dir():
            for path in logs.iterdir():
                if path in self._files:
                    continue
                match = _RANK_LOG.search(path.name)
                if match:
                    self._files[path] = Followed(path, int(match.group(1)))
                elif path == paths.launcher_log and self.include_launcher:
                    self._files[path] = Followed(path, None)
        return sorted(self._files.values(), key=lambda f: (f.rank is not None, f.rank or 0))

    def _read_lines(self, followed: Followed, final: bool) -> Iterator[LogLine]:
        if followed.rank is not None and followed.kept is None:
            report = read_json(self.run_dir.rank_log_cap(followed.rank))
            followed.kept = report.get("kept") if isinstance(report, dict) else None
        for raw in read_complete(followed, final, limit=None if final else followed.kept, budget=READ_BYTES):
            text = raw.rstrip(b"\r").rsplit(b"\r", 1)[-1]  # what a terminal shows after redraws
            glued = _GLUED_TO_BAR.match(text) if b"\r" in raw else None
            if glued:  # the bar's state, then another writer's line: each is what it is
                bar, text = glued.groups()
                if bar != followed.shown_progress:
                    followed.shown_progress = bar
                    yield LogLine(followed.rank, bar.decode("utf-8", errors="replace"), progress=True)
            yield LogLine(followed.rank, text.decode("utf-8", errors="replace"))
        if b"\r" in followed.partial:  # a progress bar being redrawn: show its latest state
            current = followed.partial.rsplit(b"\r", 1)[0].rsplit(b"\r", 1)[-1]
            if current and current != followed.shown_progress:
                followed.shown_progress = current
                yield LogLine(followed.rank, current.decode("utf-8", errors="replace"), progress=True)


def read_complete(followed: Followed, final: bool, limit: int | None = None, budget: int | None = None) -> list[bytes]:
    """The complete lines appended to ``followed.path`` since the last call (``final``: the unterminated one too).

    ``limit``: read nothing beyond this offset (a capped log's kept start); ``budget``: read at most this many
    bytes now (the rest on the next call), and on the ``final`` call, when more than :data:`LAST_READ_BYTES`
    is left, only its last bytes, after a line that says how much is only in the file.
    """
    skipped = 0
    try:
        with open(followed.path, "rb") as f:
            end = os.fstat(f.fileno()).st_size if limit is None else limit
            if followed.offset > end:
                followed.offset = end  # (a file cut shorter than what was read of it: follow from its end)
            if final and budget is not None and end - followed.offset > LAST_READ_BYTES:
                skipped = end - LAST_READ_BYTES - followed.offset
                followed.offset, followed.partial = end - LAST_READ_BYTES, b""
            f.seek(followed.offset)
            data = f.read(end - followed.offset if budget is None or final else min(budget, end - followed.offset))
    except FileNotFoundError:
        return []
    followed.offset += len(data)
    if skipped:  # the first line read is part of one that was skipped
        data = data.split(b"\n", 1)[-1]
    data = followed.partial + data
    lines = data.split(b"\n")
    followed.partial = lines.pop()
    if final and followed.partial:
        lines.append(followed.partial)
        followed.partial = b""
    if skipped:
        lines.insert(0, f"[nbddp] … {size(skipped)} of output not shown here: {followed.path} has it".encode())
    return lines


def rank_prefix(rank: int | None, every_rank: bool = False) -> str:
    if every_rank:
        return "[all ranks] "
    return "[launcher] " if rank is None else f"[rank {rank}] "
