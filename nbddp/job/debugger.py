"""Relay a rank's debugger to the person running the job: its output shown, each prompt answered.

The rank side (:mod:`nbddp.rank_side.debugger`) runs pdb over a
:class:`~nbddp.contracts.debug_channel.DebugChannel`; this side reads what it wrote and answers each prompt with
what the door's :class:`Console` reads: ``input()`` in a kernel (the front end's input box: JupyterLab, Notebook,
VS Code, a jupyter_client with ``allow_stdin``) or in ``nbddp run``'s terminal. The job calls :func:`relay_open`
on every poll (:meth:`nbddp.job.lifecycle.Job.wait`), so a ``breakpoint()`` opens where the run was started; the
``%ddp_debug`` magic relays a warm rank's post-mortem the same way.
"""

from __future__ import annotations

import builtins
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from nbddp.contracts.debug_channel import POLL_SECONDS, DebugChannel, channels_under
from nbddp.contracts.process_groups import process_alive

if TYPE_CHECKING:
    from nbddp.launchers.warm.pool import WarmPool

#: How each session starts: what the rank is, and what to type.
HELP = "p EXPR / pp EXPR print, up / down, l list, where, c go on, q quit"


@dataclass(frozen=True)
class Console:
    """How a door talks to a person: ``ask(prompt)`` reads one line (``EOFError``: nobody will answer),
    ``show(text)`` writes text as it comes."""

    # (ipykernel replaces builtins.input per cell: looked up when asked)
    ask: Callable[[str], str] = lambda prompt: builtins.input(prompt)
    show: Callable[[str], None] = lambda text: print(text, end="", flush=True)


@dataclass
class Relayed:
    """The sessions of one run already relayed (each is relayed once, start to end)."""

    folder: Path
    done: set[Path] = field(default_factory=set)


def relay_open(sessions: Relayed, console: Console, running: Callable[[], bool], others_wait: bool = True) -> float:
    """Relay every session opened in ``sessions.folder`` and not relayed yet, each to its end; the seconds spent
    (a run's time limits don't count the time a person spent in the debugger)."""
    if not sessions.folder.is_dir():
        return 0.0
    spent = 0.0
    for channel in channels_under(sessions.folder):
        if channel.path not in sessions.done:
            sessions.done.add(channel.path)
            started = time.monotonic()
            relay(channel, console, running, others_wait)
            spent += time.monotonic() - started
    return spent


def relay(channel: DebugChannel, console: Console, running: Callable[[], bool] = lambda: True,
          others_wait: bool = True) -> None:
    """Relay ``channel``'s session until it closes, its rank is gone or the job ended (``running()`` false).

    ``KeyboardInterrupt`` (the user stops the cell) tells the debugger to leave, and goes on."""
    description = channel.description() or {}
    rank, pid = description.get("rank", "?"), description.get("pid")
    wait = f" (the other ranks are waiting for rank {rank}'s debugger at their next collective)" if others_wait else ""
    console.show(f"[nbddp] rank {rank}'s debugger{wait}: {HELP}\n")
    shown, number, left = 0, 1, False
    while True:
        asked = None if left else channel.asked(number)
        if asked is not None:
            text, shown = _read(channel, shown, asked)
            before, _, prompt = text.rpartition("\n")
            if before:
                console.show(before + "\n")
            try:
                line = console.ask(prompt)
            except KeyboardInterrupt:
                channel.leave()
                raise
            except Exception:  # noqa: BLE001 - EOFError, or a front end that takes no input: nobody answers
                channel.leave()  # (the debugger reads end-of-file: a breakpoint's rank goes on)
                left = True
                continue
            channel.reply(number, line)
            number += 1
            continue
        closed = channel.closed_mark.exists()
        text, shown = _read(channel, shown, None if closed else "lines")
        if text:
            console.show(text)
        if closed:
            return
        if (isinstance(pid, int) and not process_alive(pid)) or not running():
            channel.leave()
            text, shown = _read(channel, shown, None)
            console.show(text)
            return
        time.sleep(POLL_SECONDS)


def _read(channel: DebugChannel, start: int, end: int | str | None) -> tuple[str, int]:
    """What the debugger wrote from byte ``start``: up to ``end`` (a size), its complete lines (``"lines"``), or
    all of it (``None``); and where the next read starts."""
    try:
        with open(channel.out, "rb") as out:
            out.seek(start)
            data = out.read() if not isinstance(end, int) else out.read(max(0, end - start))
    except OSError:
        return "", start
    if end == "lines":
        data = data[:data.rfind(b"\n") + 1]
    return data.decode("utf-8", "replace"), start + len(data)


def post_mortem(pool: WarmPool, rank: int, console: Console) -> None:
    """``%ddp_debug``: hand the warm ranks a post-mortem of ``rank``'s kept failure and relay its session; returns
    once the rank has left it (``q`` or ``c``). ``KeyboardInterrupt`` (the cell stopped) ends the session, and
    the job, first."""
    run, folder = pool.submit_post_mortem(rank)
    sessions = Relayed(folder)

    def running() -> bool:
        return run.poll() is None

    try:
        while running():
            relay_open(sessions, console, running, others_wait=False)
            time.sleep(POLL_SECONDS)
        relay_open(sessions, console, running, others_wait=False)  # (one the rank opened and closed at once)
    except BaseException:
        for channel in channels_under(folder):
            channel.leave()
        run.stop()
        raise
