"""What the ranks print, made readable before any sink sees it: each thing said once, in the notebook's terms.

Between the run dir's files and the sinks (terminal, live view, executed notebook):

* a rank's traceback is held until it is complete, then shown once, its frames in the
  generated script translated to notebook cells (``[nb.ipynb, cell 3, line 5]``) and torch's
  own ``[rankN]:`` line prefix removed;
* a traceback that only says a peer went away (gloo's "Connection closed by peer", a reset
  connection) becomes one line: the rank that failed first has the traceback that matters;
* a warning printed by every rank is shown once, as ``[all ranks]``: Python's (``file:line: XWarning:``,
  its message and source line) and torch's C++ ones (``[W1125 16:48:23.384552090 reducer.cpp:1529]
  Warning: …``, one line, told apart from another rank's copy by its time only).

Holding never loses a line: whatever is held is let go after ``hold`` seconds, and on the final poll.
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from nbddp.job.outcome import PEER_GONE
from nbddp.contracts.sourcemap import SourceMap
from nbddp.job.follow import Event, LogLine

_TORCH_PREFIX = re.compile(r"^\[rank(\d+)\]: ?")
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")
#: c10's warning line (``TORCH_WARN``): ``[W<MMDD> <time> <file>:<line>] <message>``; before torch 2.4 without the time.
_CPP_WARNING = re.compile(r"^\[W(\d{4} \d\d:\d\d:\d\d\.\d+ )?[^\]\s]+:\d+\] ")
HOLD_SECONDS = 1.0
WARNING_LINES = 8


@dataclass
class _Warning:
    lines: tuple[str, ...]
    first_seen: float
    ranks: set = field(default_factory=set)
    shared: bool = False
    """Every rank printed it: shown once, by whichever rank's queue reaches it first."""
    shown: bool = False
    """A shared warning, shown: the other ranks' queues skip it."""


@dataclass(frozen=True)
class _Later:
    """A line shown only after ``until`` (a peer's "connection closed" after the failing rank's traceback)."""

    line: LogLine
    until: float


@dataclass
class _RankState:
    queue: deque = field(default_factory=deque)
    """Lines (``LogLine``) and warnings (``_Warning``) waiting, in the order the rank printed them."""
    block: list[str] | None = None
    """A traceback being collected."""
    block_ended: bool = False
    last_seen: float = 0.0
    warning: list[str] | None = None
    """A warning's lines (its message may span several), waiting for the source line Python prints under it."""
    warning_since: float = 0.0


class QuietStream:
    """Feed it each poll's events (:meth:`feed`); it returns what to show now."""

    def __init__(self, source_map: SourceMap | None, ranks: Sequence[int], hold: float = HOLD_SECONDS) -> None:
        self.source_map = source_map
        self.ranks = set(ranks)
        self.hold = hold
        self._states: dict[int | None, _RankState] = {}
        self._warnings: dict[tuple[str, ...], _Warning] = {}

    def feed(self, events: Iterable[Event], final: bool = False, now: float | None = None) -> list[Event]:
        now = time.monotonic() if now is None else now
        out: list[Event] = []
        for event in events:
            if isinstance(event, LogLine) and not event.progress and event.rank is not None:
                self._line(event.rank, event.text, now)
            else:
                out.append(event)
        for rank, state in self._states.items():
            if state.block is not None and (final or now - state.last_seen > self.hold):
                self._end_block(rank, state)
            if state.warning is not None and (final or now - state.last_seen > self.hold):
                self._end_warning(rank, state, now)
        return self._drain_all(now, final) + out

    def _line(self, rank: int, text: str, now: float) -> None:
        state = self._states.setdefault(rank, _RankState())
        state.last_seen = now
        prefix = _TORCH_PREFIX.match(text)
        if prefix and int(prefix.group(1)) == rank:
            text = text[prefix.end():]
        if state.warning is not None:
            if text.startswith((" ", "\t")):  # the source line Python prints under a warning ends it
                state.warning.append(text)
                self._end_warning(rank, state, now)
                return
            if _WARNING.match(text) or _CPP_WARNING.match(text) or text == _TRACEBACK \
                    or len(state.warning) >= WARNING_LINES:
                self._end_warning(rank, state, now)
            else:
                state.warning.append(text)  # the message went on over several lines
                return
        if state.block is not None:
            if not state.block_ended:
                state.block.append(text)  # the exception's own line ends it (not indented, not a header)
                state.block_ended = bool(text.strip()) and not text.startswith((" ", "\t", _TRACEBACK, *_CHAINED))
                return
            if not text.strip() or text.startswith(_CHAINED) or text == _TRACEBACK:
                state.block.append(text)  # a blank line, or a chained exception follows
                state.block_ended = not text.strip()
                return
            self._end_block(rank, state)  # a line after the exception is not part of it
        if text == _TRACEBACK:
            state.block, state.block_ended = [text], False
        elif _WARNING.match(text) and len(self.ranks) > 1:
            state.warning, state.warning_since = [text], now
        elif _CPP_WARNING.match(text) and len(self.ranks) > 1:  # one line, complete as it is
            state.warning, state.warning_since = [text], now
            self._end_warning(rank, state, now)
        else:
            state.queue.append(LogLine(rank, text))

    def _end_block(self, rank: int, state: _RankState) -> None:
        lines = state.block or []
        while lines and not lines[-1].strip():
            lines.pop()
        state.block, state.block_ended = None, False
        last = next((line for line in reversed(lines) if line.strip()), "")
        if PEER_GONE.search(last) and len(self.ranks) > 1:
            kind = last.split(":", 1)[0] if re.match(r"^[\w.]+:", last) else "an error"
            line = LogLine(rank, f"stopped by {kind}: {_peer_phrase(last)} (another rank failed or went away first)")
            state.queue.append(_Later(line, state.last_seen + self.hold))
            return
        text = "\n".join(lines)
        if self.source_map is not None:
            text = self.source_map.translate_traceback(text)
        state.queue.extend(LogLine(rank, line) for line in text.split("\n"))

    def _end_warning(self, rank: int, state: _RankState, now: float) -> None:
        lines = tuple(state.warning or ())
        key = _same_everywhere(lines)
        state.warning = None
        warning = self._warnings.get(key)
        if warning is None or warning.shown or rank in warning.ranks or now - warning.first_seen > self.hold:
            warning = self._warnings[key] = _Warning(lines, state.warning_since)
        warning.ranks.add(rank)
        warning.shared = warning.ranks >= self.ranks
        state.queue.append(warning)

    def _drain_all(self, now: float, final: bool) -> list[Event]:
        shown = self._drain(now, False, laters=False)  # (the last poll too: a shared warning waits for earlier lines)
        return shown + self._drain(now, final, laters=False) + self._drain(now, final, laters=True) if final else shown

    def _drain(self, now: float, final: bool, laters: bool) -> list[Event]:
        """Every rank's lines that can be shown, in each rank's order.

        A warning every rank printed is shown once every rank's earlier lines have been, so
        ``[all ranks]`` never jumps ahead of what a rank printed before it.
        """
        shown: list[Event] = []
        moved = True
        while moved:
            moved = False
            for rank, state in self._states.items():
                while state.queue:
                    head = state.queue[0]
                    if isinstance(head, LogLine):
                        shown.append(head)
                    elif isinstance(head, _Later):
                        if not laters and now < head.until:
                            break
                        shown.append(head.line)
                    elif head.shared and head.shown:
                        pass  # another rank's queue showed it for all
                    elif head.shared and all(self._states[r].queue and self._states[r].queue[0] is head
                                             for r in head.ranks):
                        head.shown = True
                        shown.extend(LogLine(min(head.ranks), line, every_rank=True) for line in head.lines)
                    elif final or now - head.first_seen > self.hold:
                        head.shared = False  # not every rank printed it in time: each its own copy
                        shown.extend(LogLine(rank, line) for line in head.lines)
                    else:
                        break
                    state.queue.popleft()
                    moved = True
        return shown


def _same_everywhere(lines: tuple[str, ...]) -> tuple[str, ...]:
    """A warning as every rank prints it alike: a C++ warning's time of day differs from rank to rank."""
    first = _CPP_WARNING.match(lines[0]) if lines else None
    if first is None or first.group(1) is None:
        return lines
    return (lines[0][:2] + lines[0][first.end(1):], *lines[1:])


def _peer_phrase(message: str) -> str:
    """The words of a peer-gone error that say what happened (gloo's, NCCL's, the socket's)."""
    for phrase in (r"connection \w+ by peer", r"connection (?:closed|reset|refused)", r"broken pipe", r"\w+ by peer"):
        match = re.search(phrase, message, re.IGNORECASE)
        if match:
            return match.group(0)
    return "a peer went away"
