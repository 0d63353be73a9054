"""Detached runs (``--detach``): a supervisor process owns the job, so whoever started it may go.

:func:`start` writes what to run into the run dir (as data: :mod:`nbddp.doors.detached_request`) and starts
the supervisor, ``python -m
nbddp.doors.detached RUN_DIR``, which forks once so that it is nobody's child: in a session of its own
and without a terminal, no Ctrl-C, hang-up, kernel restart or closed SSH session reaches it, and the
launcher's parent-death ties the ranks to *it*. It runs the job through the orchestrator as any door
does (``nbddp run``'s notebook kernel, or no kernel for ``%%ddp_train``, whose weights wait in the run
dir), so ``result.json`` is written whether or not anyone is watching, and ``nbddp kill`` interrupts it
as it would ``nbddp run`` (SIGTERM).

:func:`follow` is attaching: every line the run dir holds from the start, then live, until
``result.json`` says how the run ended; the door then loads the weights as after a normal run.
Leaving (Ctrl-C, the stop button, a kernel restart) only stops the following.

Nothing here imports torch, IPython or the orchestrator at module level: the supervisor forks first.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from nbddp.contracts.atomic import read_json, write_json
from nbddp.doors.detached_request import read_error, read_request, write_error, write_request
from nbddp.doors.signals import signals_interrupt
from nbddp.contracts.errors import NbddpError, RunFailed, UsageError
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.owned import NotYours, check_owned, private_folder, touch
from nbddp.contracts.process_groups import RECORD_SECONDS, STOP_GRACE
from nbddp.contracts.interpreter import module_argv

#: How often an attached door reads the run dir (a detached run is long; a tenth of a second is live).
POLL_SECONDS = 0.1
#: How long the starter waits for the supervisor to exist (a Python start and one fork).
START_SECONDS = 60.0
#: How long an attached door waits, once the run's result is written, for its supervisor to finish what comes after
#: (the run's experiment records: nbddp's facts added, a W&B record of its own written, :mod:`nbddp.job.trackers`).
AFTER_RESULT_SECONDS = 150.0
#: What refusing another user's run says to do.
ONLY_YOURS = "You can follow and stop only runs of your own."
#: What a detached ``%%ddp_train`` run's ending says of its weights (the supervisor has no kernel to load them into).
WEIGHTS_WAIT = "the weights wait in the run dir for %ddp_attach"


def start(what: Any, paths: RunDir, cwd: Path) -> int:
    """Start the supervisor of ``what`` (``nbddp run``'s ``RunOptions`` or ``%%ddp_train``'s ``RunRequest``,
    whose ``launch.run_dir`` is ``paths``' folder); returns its pid once it runs.

    Raises:
        NbddpError: it could not start (the run dir is removed: nothing ran).
        KeyboardInterrupt: Ctrl-C while it started (a supervisor that got to start is stopped).
    """
    private_folder(paths.detached, "the detached run's folder")
    write_request(paths, what)
    try:  # returns once the supervisor has written its pid and let go of the pipes (or failed)
        proc = subprocess.run(module_argv("nbddp.doors.detached", str(paths.path)), cwd=cwd,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=START_SECONDS)
    except (KeyboardInterrupt, subprocess.TimeoutExpired) as exc:
        if supervisor_alive(paths):
            os.kill(int(read_json(paths.supervisor)["pid"]), signal.SIGTERM)  # the user didn't want it to start
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise NbddpError(f"the run's supervisor did not start within {START_SECONDS:g} s; "
                         f"see {paths.supervisor_log}") from None
    info = read_json(paths.supervisor)
    if proc.returncode != 0 or not info:
        shutil.rmtree(paths.path, ignore_errors=True)
        raise NbddpError(f"the run's supervisor could not start (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
    return int(info["pid"])


def main(argv: Sequence[str] | None = None) -> int:
    """The supervisor: fork away from the starter, then run the job and record how it ended.

    The starter's Ctrl-C or hang-up must not catch it half-way: both are ignored until it is in a
    session of its own; it writes its pid (and start time, so a recycled pid is never taken for it)
    before it lets go of the starter's pipes, so the starter finds it when its child returns.
    """
    import psutil

    paths = RunDir(Path((sys.argv[1:] if argv is None else argv)[0]))
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if os.fork():
        os._exit(0)  # the starter's own child goes; the supervisor is re-parented (nobody's child)
    os.setsid()  # no terminal, no process group of the kernel's: none of their signals reach it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with signals_interrupt():  # nbddp kill: SIGTERM, recorded as an interruption, from now on
        try:
            write_json(paths.supervisor, {"pid": os.getpid(), "created": psutil.Process().create_time(),
                                          "started": time.time()})
            log = os.open(paths.supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)  # (the umask applies)
            null = os.open(os.devnull, os.O_RDONLY)
            for fd, target in ((0, null), (1, log), (2, log)):
                os.dup2(target, fd)
            for name, fd in (("stdout", 1), ("stderr", 2)):  # line-buffered into the transcript, whatever the locale
                setattr(sys, name, open(fd, "w", buffering=1, encoding="utf-8",  # noqa: SIM115 - sys's, for good
                                        errors="backslashreplace", closefd=False))
            return _supervise(paths)
        except BaseException as exc:  # noqa: BLE001 - whatever ends it before the run is recorded: the attacher says why
            return _stopped_before_recording(paths, exc)


def _supervise(paths: RunDir) -> int:
    from nbddp.display.ending import ending_of
    from nbddp.display.terminal import TerminalSink
    from nbddp.doors.notebook_run import RunOptions, run_notebook
    from nbddp.job import orchestrator

    check_owned(paths.path, "the detached run", follow=True)
    what = read_request(paths)

    def started(job: Any) -> None:  # what an attached door needs to show the job as its own run does
        _tell(paths, ranks=list(job.local_ranks()), launcher_log=job.launcher.streams_launcher_log)

    def say(text: str) -> None:  # (stdout and stderr are the transcript: supervisor.log)
        print(text, flush=True)

    if isinstance(what, RunOptions):  # its terminal's transcript: what nbddp attach replays (and makes terminal-safe)
        result = run_notebook(dataclasses.replace(what, raw_output=True), say=say, on_start=started)
    else:
        waits = orchestrator.NoKernel(WEIGHTS_WAIT, once_weights=True)  # (for a kernel to attach)
        result = orchestrator.run(what, waits, [TerminalSink(raw=True)], lambda t: say(f"nbddp: {t}"), on_start=started)
        say(f"nbddp: {ending_of(result).line()}")
    error = result.error()
    if error is not None:  # the judged error (rank, cell, line), for an attached kernel to raise as its own run would
        write_error(paths, error)
    return result.exit_code


def _stopped_before_recording(paths: RunDir, exc: BaseException) -> int:
    """Say why the supervisor ends without a ``result.json`` (refused, stopped, broken), where attachers look."""
    from nbddp.contracts.errors import SignalReceived, stop_signal
    from nbddp.contracts.status import Status

    if isinstance(exc, (SignalReceived, KeyboardInterrupt)):
        signum = stop_signal(exc)
        why, code = f"stopped ({signal.Signals(signum).name}) before it started", Status.INTERRUPTED.code(signum)
    elif isinstance(exc, NbddpError):
        why, code = str(exc), exc.exit_code
    else:
        why, code = f"{type(exc).__name__}: {exc}", 1
        traceback.print_exc()
    if not paths.result.exists():
        print(f"nbddp: error: {why}", flush=True)
        _tell(paths, error=why)
    return code


def _tell(paths: RunDir, **facts: Any) -> None:
    """Add ``facts`` to ``detached/supervisor.json`` (written whole: attachers read it at any time)."""
    write_json(paths.supervisor, {**(read_json(paths.supervisor) or {}), **facts})


def supervisor_alive(paths: RunDir) -> bool:
    """Whether the run's supervisor still runs (not another process that was given its pid since)."""
    import psutil

    info = read_json(paths.supervisor) or {}
    try:
        proc = psutil.Process(int(info.get("pid", 0)))
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - float(info.get("created", 0))) < 1.0
    except (psutil.Error, ValueError):
        return False


def stop(paths: RunDir, grace: float = STOP_GRACE + RECORD_SECONDS) -> bool:
    """``nbddp kill`` of a detached run whose job isn't registered yet (or any more): SIGTERM its supervisor,
    which records why it ends (no launcher's ranks to stop: a local one's grace at most); True once it has."""
    if not supervisor_alive(paths):
        return True
    touch(paths.stop_mark)
    os.kill(int(read_json(paths.supervisor)["pid"]), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while supervisor_alive(paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not supervisor_alive(paths)


def is_detached(paths: RunDir) -> bool:
    """A run dir whose run a supervisor owns (``--detach``)."""
    return paths.supervisor.exists()


def find_run(which: str, cwd: Path) -> RunDir:
    """A detached run by its run dir (as a run prints it), its name under ``cwd/runs``, or a live run's name."""
    from nbddp.job.registry import find

    for candidate in (Path(which).expanduser(), Path(cwd) / "runs" / which):
        if candidate.is_dir():
            run_dir = candidate.resolve()
            break
    else:
        try:
            run_dir = Path(find(which).run_dir)
        except UsageError:  # (nbddp ps lists live runs only: attach also replays an ended one, by its folder)
            raise UsageError(f"no run {which!r}: give a detached run's folder (as its start line printed it: "
                             f"runs/NAME beside its notebook), or its name under {Path(cwd) / 'runs'}; `nbddp ps` "
                             "lists the runs alive now.") from None
    check_owned(run_dir, "the run", follow=True, then=ONLY_YOURS)
    paths = RunDir(run_dir)
    if not is_detached(paths):
        raise UsageError(f"{run_dir} is not a detached run: only runs started with --detach can be attached "
                         f"(its logs are in {paths.logs}).")
    return paths


def latest(notebook: Path) -> RunDir:
    """The newest detached run of ``notebook`` (``runs/<stem>-<time>`` beside it) of the user's own: what
    ``--attach`` alone means."""
    import re

    runs = Path(notebook).resolve().parent / "runs"
    named = re.compile(re.escape(Path(notebook).stem) + r"-\d{8}-\d{6}(-\d+)?$")
    found = [RunDir(d) for d in runs.iterdir() if named.match(d.name) and _yours(d)] if runs.is_dir() else []
    found = [paths for paths in found if is_detached(paths)]
    if not found:
        raise UsageError(f"no detached run of {Path(notebook).name} in {runs}: start one with --detach, "
                         "or name the run dir to attach to.")
    return max(found, key=lambda paths: (read_json(paths.supervisor) or {}).get("started", 0.0))


def _yours(run_dir: Path) -> bool:
    """A run of the user's own (in a shared project folder, colleagues' runs of the same notebook are beside it)."""
    try:
        check_owned(run_dir, "the run", follow=True)
        return True
    except (NotYours, OSError):
        return False


def raise_judged(run_dir: RunDir, record: Any) -> None:
    """Raise the error a run that didn't succeed raised in its supervisor (the judged one: rank, cell, line)."""
    from nbddp.contracts.errors import JUDGED, error_for

    error = read_error(run_dir)
    if error is not None:
        raise error
    judged = {name: value for name, value in (record.failure or {}).items() if name in JUDGED}
    raise error_for(record.status, record.error or f"the run ended {record.status}", record.exit_code, str(run_dir),
                    **judged)


def follow(paths: RunDir, sinks: Sequence[Callable[[Any], None]], heartbeat: Callable[[], Any] | None = None,
           on_ranks: Callable[[list[int]], Any] | None = None) -> Any:
    """Stream the run's every line (the earlier ones first) until it ends; returns its ``RunRecord``.

    ``on_ranks(ranks)``: once the job's ranks are known (a view appears); ``heartbeat()``: on every poll
    (whatever it raises stops the following, not the run).

    Raises:
        UsageError: ``paths`` is not a detached run.
        RunFailed: the supervisor is gone without a result (it was killed), or refused the run.
    """
    from nbddp.job.follow import RunFollower
    from nbddp.job.rank_output import QuietStream
    from nbddp.job.record import RunRecord
    from nbddp.contracts.sourcemap import SourceMap, sourcemap_path

    _supervisor_info(paths)
    follower = quiet = None
    while True:
        info = read_json(paths.supervisor) or {}
        record = RunRecord.read(paths)
        if follower is None and ("ranks" in info or record is not None):
            ranks = info["ranks"] if "ranks" in info else list(range(record.world_size))
            if on_ranks is not None:
                on_ranks(ranks)
            follower = RunFollower(paths, include_launcher=bool(info.get("launcher_log")))
            source_map = sourcemap_path(paths.script)
            quiet = QuietStream(SourceMap.load(source_map) if source_map.exists() else None, ranks)
        if follower is not None:
            for event in quiet.feed(list(follower.poll(final=record is not None)), final=record is not None):
                for sink in sinks:
                    sink(event)
        if record is not None:
            _supervisor_done(paths, heartbeat)
            return record
        if info.get("error") or not supervisor_alive(paths) and not paths.result.exists():
            raise _gone(paths, read_json(paths.supervisor) or info)
        if heartbeat is not None:
            heartbeat()
        time.sleep(POLL_SECONDS)


def _supervisor_done(paths: RunDir, heartbeat: Callable[[], Any] | None) -> None:
    """Wait (at most :data:`AFTER_RESULT_SECONDS`) for the supervisor to end once the run's result is written: what
    it does after (the experiment records' ending) is over when the attached door says the run is."""
    deadline = time.monotonic() + AFTER_RESULT_SECONDS
    while supervisor_alive(paths) and time.monotonic() < deadline:
        if heartbeat is not None:
            heartbeat()
        time.sleep(POLL_SECONDS)


def replay(paths: RunDir, write: Callable[[str], Any]) -> Any:
    """``write`` the supervisor's transcript (what ``nbddp run`` would have shown in its terminal: the
    ranks' lines, the notebook's cells, the ending), from its first line until the supervisor has
    ended; returns the run's ``RunRecord``.

    Raises:
        UsageError: ``paths`` is not a detached run.
        RunFailed: the supervisor is gone without a result (it was killed).
    """
    from nbddp.job.follow import Followed, read_complete
    from nbddp.job.record import RunRecord

    info = _supervisor_info(paths)
    transcript = Followed(paths.supervisor_log, None)
    while True:
        supervisor_gone = not supervisor_alive(paths)  # before the read: then that read is the last
        for line in read_complete(transcript, final=supervisor_gone):
            write(line.decode("utf-8", errors="replace") + "\n")
        if supervisor_gone:
            record = RunRecord.read(paths)
            if record is None:
                raise _gone(paths, read_json(paths.supervisor) or info)
            return record
        time.sleep(POLL_SECONDS)


def _supervisor_info(paths: RunDir) -> dict:
    info = read_json(paths.supervisor)
    if info is None:
        raise UsageError(f"{paths.path} is not a detached run (it has no {paths.supervisor.relative_to(paths.path)}).")
    return info


def _gone(paths: RunDir, info: dict) -> RunFailed:
    if info.get("error"):
        return RunFailed(f"the detached run ended before it started: {info['error']}", run_dir=str(paths.path))
    return RunFailed(f"the detached run's supervisor (pid {info.get('pid')}) is gone and left no result: it was "
                     f"killed, and its ranks with it. Its last words: {paths.supervisor_log}", run_dir=str(paths.path))


def ending(record: Any, run_dir: RunDir, weights: str | None = None) -> Any:
    """The one line a followed run ends with, from its ``result.json``."""
    from nbddp.display.ending import NO_WEIGHTS, Ending, first_line

    weights = weights or NO_WEIGHTS
    return Ending(record.status, record.wall_time_s, run_dir.path, weights, first_line(record.error or ""),
                  record.final_metrics, {int(rank): peak for rank, peak in record.peak_memory.items()},
                  {int(rank): n for rank, n in record.dropped_output.items()})


def how_to_return(run_dir: RunDir, in_kernel: bool) -> str:
    """What a door says when it stops following: the run goes on, and how to reach it again."""
    from nbddp.display.ending import shown_path

    where = shown_path(run_dir.path)
    again = f"%ddp_attach {where}" if in_kernel else f"nbddp attach {where}"
    return f"the run goes on: `{again}` follows it again, `nbddp kill {where}` stops it"


if __name__ == "__main__":
    sys.exit(main())
