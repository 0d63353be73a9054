"""A rank's debugger: :mod:`pdb` in the rank, typed into from the notebook or the terminal.

A rank has no terminal, so its debugger talks through a :class:`~nbddp.contracts.debug_channel.DebugChannel`
that the process following the run relays (:mod:`nbddp.job.debugger`): the kernel shows the debugger's
output in the cell and asks for each command with ``input()`` (the front end's input box), ``nbddp run`` asks in
its terminal. Three ways in:

* ``breakpoint()`` in a training cell (rank 0's; ``nbddp.breakpoint(rank=1)``, another's; ``rank="all"``: each
  rank's in turn): the rank stops there; the others run on to their next collective and wait for it, as any rank
  waits for a slow peer; ``c`` goes on.
  Nobody to type into it (papermill, a batch, a detached run: ``NBDDP_DEBUGGER`` unset): skipped, said once.
* ``nbddp run --debug-on-failure``: a rank's uncaught exception opens a post-mortem before the rank ends.
* ``%ddp_debug``: a warm rank's kept failure, in a job of its own (:mod:`nbddp.rank_side.warm.loop`).

Every frame the debugger names (``where``, ``up``, the ``>`` line) gets its notebook cell and line beside it, as
tracebacks do. Not a fork of pdb: :class:`RelayedPdb` only changes where pdb reads and writes.
"""

from __future__ import annotations

import os
import pdb
import sys
from pathlib import Path
from types import FrameType, TracebackType
from typing import Callable

from nbddp.contracts.debug_channel import DebugChannel
from nbddp.contracts.rank_env import RankEnv
from nbddp.contracts.sourcemap import SourceMap


def relocate(filename: str, line: int) -> tuple[str, int]:
    """A frame's (file, line) in the current job's script, where a warm rank's kept cells were compiled in an
    earlier job's script (:mod:`nbddp.rank_side.warm.loop` replaces this function); as it is elsewhere."""
    return filename, line


#: How many sessions this process opened (each gets a channel of its own), and the run dirs where a skipped
#: breakpoint was said already.
_sessions = 0
_skipped_in: set[str] = set()


class _Output:
    """pdb's stdout: the current channel's ``out``."""

    def __init__(self, channel: DebugChannel) -> None:
        self.channel = channel

    def write(self, text: str) -> int:
        self.channel.write(text)
        return len(text)

    def flush(self) -> None:
        pass


class _Input:
    """pdb's stdin: each line the relay's answer. An interrupt (the run being stopped) reads as end-of-file, which
    pdb takes as ``quit``, and :class:`RelayedPdb` then lets the interrupt go on; a relay gone (nobody will answer)
    reads as ``c``: the rank goes on."""

    def __init__(self, channel: DebugChannel) -> None:
        self.channel, self.lines, self.interrupted = channel, 0, False

    def readline(self) -> str:
        self.lines += 1
        try:
            return self.channel.read_line(self.lines) or "c\n"
        except KeyboardInterrupt:
            self.interrupted = True
            return ""


class RelayedPdb(pdb.Pdb):
    """pdb reading and writing through a channel; each frame line with its notebook cell.

    One session per stop: ``c`` closes it (the rank runs on), and the next stop (a breakpoint set with ``b``, another
    ``breakpoint()``) opens a new channel in the same folder, which the relay finds as it found the first."""

    def __init__(self, folder: Path, rank: int, why: str, where: Callable[[str, int], str | None]) -> None:
        self.folder, self.rank, self.why, self._where = folder, rank, why, where
        channel = self._open()
        self._input, self._output = _Input(channel), _Output(channel)
        super().__init__(stdin=self._input, stdout=self._output, nosigint=True, readrc=False)

    @property
    def channel(self) -> DebugChannel:
        return self._input.channel

    def _open(self) -> DebugChannel:
        channel = new_channel(self.folder, self.rank)
        channel.open(self.rank, self.why)
        return channel

    def format_stack_entry(self, frame_lineno: tuple[FrameType, int], lprefix: str = ": ") -> str:
        text = super().format_stack_entry(frame_lineno, lprefix)
        frame, line = frame_lineno
        where = self._where(frame.f_code.co_filename, line)
        return f"{text}  [{where}]" if where else text

    def set_continue(self) -> None:
        super().set_continue()
        self.channel.close()  # the rank runs on; a later stop opens a session of its own

    def set_quit(self) -> None:
        super().set_quit()
        self.channel.close()

    def interaction(self, frame: FrameType | None,
                    tb_or_exc: TracebackType | BaseException | None) -> None:  # (3.13 passes an exception)
        if self.channel.closed_mark.exists():  # a stop after `c`: a new session
            self._input.channel = self._output.channel = self._open()
            self._input.lines = 0
        super().interaction(frame, tb_or_exc)
        if self._input.interrupted:  # the run was stopped while the debugger waited: stop as an interrupt does
            self.channel.close()
            sys.settrace(None)
            raise KeyboardInterrupt


def notebook_lines(script: str | Path | None) -> Callable[[str, int], str | None]:
    """``(file, line) → "nb.ipynb, cell 3, line 2"`` for the lines of ``script`` (``None`` elsewhere, or without
    its source map)."""
    source_map = SourceMap.beside(script)
    if source_map is None:
        return lambda filename, line: None
    script = os.path.abspath(script)

    def where(filename: str, line: int) -> str | None:
        filename, line = relocate(filename, line)
        return source_map.where(line) if os.path.abspath(filename) == script else None
    return where


def _rank() -> int:
    """:func:`nbddp.rank_side.ranks.rank`'s answer, which this module can't import (ranks imports process, which
    imports this module)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def _script() -> str | None:
    return getattr(sys.modules.get("__main__"), "__file__", None)


def new_channel(folder: Path, rank: int) -> DebugChannel:
    """A channel of its own for this process's next session, in ``folder`` (a run dir's ``debug/``)."""
    global _sessions
    _sessions += 1
    return DebugChannel(Path(folder) / f"rank-{rank}-{os.getpid()}-{_sessions}")


#: The debugger of this process's current job (``breakpoint()`` again while it is open: the same session).
_active: RelayedPdb | None = None


def breakpoint(*args: object, rank: int | str = 0, **kwargs: object) -> None:  # noqa: A001 - the builtin's hook
    """``breakpoint()`` in a training cell (nbddp makes it :data:`sys.breakpointhook`), or
    ``nbddp.breakpoint(rank=1)``: stop ``rank`` (rank 0 by default; ``"all"``: every rank that reaches it, one
    session after another) in a debugger the notebook or terminal relays; the other ranks go on to their next
    collective and wait there. Outside nbddp (a plain ``python train.py``), Python's own."""
    global _active
    me = _rank()
    if rank != "all" and me != rank or os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    env, caller = RankEnv.from_environ(), sys._getframe(1)
    if env.run_dir is None:
        return sys.__breakpointhook__(*args, **kwargs)
    if not env.debugger:
        if str(env.run_dir) not in _skipped_in:
            _skipped_in.add(str(env.run_dir))
            print("[nbddp] breakpoint() skipped: nobody can type into a debugger here (papermill, a batch, "
                  "nbddp.run(), a detached or cluster run); %%ddp_train in a notebook, or nbddp run in a terminal, "
                  "opens it", flush=True)
        return
    if _active is not None and _active.folder == env.run_dir.debug and not _active.channel.closed_mark.exists():
        return  # (stepping through it in an open session: a line like any other)
    print(f"[nbddp] rank {me} stopped at breakpoint(): its debugger is open where the run was started; "
          "the other ranks wait at their next collective", flush=True)
    if _active is None or _active.folder != env.run_dir.debug:
        _active = RelayedPdb(env.run_dir.debug, me, "breakpoint", notebook_lines(_script()))
    _active.set_trace(caller)


def end_job() -> None:
    """A warm rank's job ended: no tracing, no breakpoint, no open session carries into the next."""
    global _active
    import threading

    sys.settrace(None)
    threading.settrace(None)
    if _active is not None:
        _active.clear_all_breaks()
        _active.channel.close()
        _active = None


def post_mortem(tb: TracebackType, folder: Path, rank: int, why: str, where: Callable[[str, int], str | None],
                headline: str = "") -> DebugChannel:
    """A debugger at the frame ``tb`` ended in (``up`` walks towards the script's top), until ``q`` or ``c``, in a
    channel of its own in ``folder``, opened with ``headline`` (the exception); the channel it used."""
    debugger = RelayedPdb(folder, rank, why, where)
    if headline:
        debugger.channel.write(headline.rstrip() + "\n")
    try:
        debugger.reset()
        debugger.interaction(None, tb)
    finally:
        debugger.channel.close()
    return debugger.channel


def on_failure(rank: int, exc: BaseException, tb: TracebackType | None) -> None:
    """``--debug-on-failure``: a post-mortem of the rank's uncaught exception, before the rank ends (its peers
    wait in their collectives meanwhile, up to ``--collective-timeout``; the launcher stops them once it ends)."""
    import bdb

    env = RankEnv.from_environ()
    if not (env.debug_on_failure and env.debugger and env.run_dir is not None and tb is not None) \
            or isinstance(exc, (KeyboardInterrupt, SystemExit, bdb.BdbQuit)):
        return
    try:  # the first rank to fail only: the others fail because it stopped (a peer gone), which says nothing new
        env.run_dir.debug.mkdir(mode=0o700, exist_ok=True)
        os.close(os.open(env.run_dir.debug_first_failure, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        return
    print(f"[nbddp] rank {rank} failed: its debugger is open where the run was started (--debug-on-failure)",
          flush=True)
    post_mortem(tb, env.run_dir.debug, rank, "failure", notebook_lines(_script()), f"{type(exc).__name__}: {exc}")


def install() -> None:
    """``breakpoint()`` in the training opens :func:`breakpoint`'s relayed session."""
    sys.breakpointhook = breakpoint

