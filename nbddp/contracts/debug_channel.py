"""A debugger session between a rank and whoever types into it, as files in a private folder.

A rank that stops in :mod:`pdb` (a ``breakpoint()``, a post-mortem) has no terminal: its stdin is nobody's and its
output goes to its log. So its debugger reads and writes through a :class:`DebugChannel`, and the process that
follows the run (the kernel, ``nbddp run``'s terminal) relays it: it shows what the debugger wrote and answers
each prompt with what the user typed (:mod:`nbddp.job.debugger`). Files, not a socket: nothing listens, and the
folder is the run dir's or the warm pool's, private to the user (what is typed here runs in the rank).

::

    CHANNEL/                        RUN_DIR/debug/rank-R-PID-K (a breakpoint, a failure; K: the process's K-th
                                    session), or POOL/debug/N/rank-R-PID-K (job N, a post-mortem)
      session.json                  the session is open: the rank, its pid, why (breakpoint, post-mortem)
      out                           what the debugger wrote, appended as it writes
      asks/K                        the debugger waits for its K-th line (it holds the size of ``out`` then)
      answers/K                     that line, as the user typed it
      quit                          the relay is gone: the debugger reads end-of-file (a breakpoint's rank goes on)
      closed                        the session ended: the rank runs on (or ends its post-mortem)

Both sides poll; a line answered a few milliseconds late is nothing to a person typing. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from nbddp.contracts.atomic import write_json, write_text
from nbddp.contracts.owned import private_folder

#: How often each side looks for the other's next file.
POLL_SECONDS = 0.01


@dataclass(frozen=True)
class DebugChannel:
    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def session(self) -> Path:
        return self.path / "session.json"

    @property
    def out(self) -> Path:
        return self.path / "out"

    def ask(self, number: int) -> Path:
        return self.path / "asks" / str(number)

    def answer(self, number: int) -> Path:
        return self.path / "answers" / str(number)

    @property
    def quit_mark(self) -> Path:
        return self.path / "quit"

    @property
    def closed_mark(self) -> Path:
        return self.path / "closed"

    # ------------------------------------------------------------------ the rank's side

    def open(self, rank: int, why: str) -> None:
        """Start a session (a fresh one: a post-mortem asked twice gets a new folder from its caller)."""
        # (inside the run dir or pool: the user's alone)
        private_folder(self.path.parent, "the debugger's folder", parents=True)
        for folder in (self.path, self.path / "asks", self.path / "answers"):
            folder.mkdir(mode=0o700, exist_ok=True)
        self.out.touch()
        write_json(self.session, {"rank": rank, "pid": os.getpid(), "why": why, "time": time.time()})

    def write(self, text: str) -> None:
        with open(self.out, "a", encoding="utf-8") as out:
            out.write(text)

    def read_line(self, number: int, interrupted: Callable[[], bool] = lambda: False) -> str:
        """The user's ``number``-th line (with its newline), or ``""`` (end of file: the debugger leaves) once the
        relay is gone or ``interrupted()``."""
        write_json(self.ask(number), self.out.stat().st_size)
        while True:
            try:
                return self.answer(number).read_text(encoding="utf-8") + "\n"
            except FileNotFoundError:
                pass
            if self.quit_mark.exists() or interrupted():
                return ""
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        self.closed_mark.touch()

    # ------------------------------------------------------------------ the relay's side

    def description(self) -> dict[str, Any] | None:
        try:
            found = json.loads(self.session.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    def asked(self, number: int) -> int | None:
        """The size ``out`` had when the debugger asked for its ``number``-th line (``None``: not asked yet)."""
        try:
            return int(json.loads(self.ask(number).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def reply(self, number: int, line: str) -> None:
        write_text(self.answer(number), line)  # (whole: the rank never reads half a line)

    def leave(self) -> None:
        """The relay can answer no more: the debugger reads end-of-file (the folder made if the rank hasn't yet)."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.quit_mark.touch()


def channels_under(folder: Path) -> list[DebugChannel]:
    """The channels in ``folder`` (a run dir's or a pool's ``debug/``), each a session some rank opened."""
    return [DebugChannel(path.parent) for path in sorted(Path(folder).glob("*/session.json"))]
