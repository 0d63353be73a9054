"""Detached runs (``--detach``): a supervisor process owns the job, so whoever started it may go.

:func:`start` pickles what to run into the run dir and starts the supervisor, ``python -m
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

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from nbddp.atomic import read_json, write_json
from nbddp.errors import NbddpError, RunFailed, UsageError
from nbddp.job.rundir import RunDir

#: How often an attached door reads the run dir (a detached run is long; a tenth of a second is live).
POLL_SECONDS = 0.1
#: How long the starter waits for the supervisor to exist (a Python start and one fork).
START_SECONDS = 60.0
#: What a detached ``%%ddp_train`` run's ending says of its weights (the supervisor has no kernel to load them into).
WEIGHTS_WAIT = "the weights wait in the run dir for %ddp_attach"


def start(what: Any, run_dir: Path, cwd: Path) -> int:
    """Start the supervisor of ``what`` (``nbddp run``'s ``RunOptions`` or ``%%ddp_train``'s ``RunRequest``,
    whose ``launch.run_dir`` is ``run_dir``); returns its pid once it runs."""
    paths = RunDir(run_dir)
    paths.detached.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths.detached_request.write_bytes(pickle.dumps(what))
    proc = subprocess.run([sys.executable, "-m", "nbddp.doors.detached", str(paths.path)], cwd=cwd,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=START_SECONDS)
    info = read_json(paths.supervisor)
    if proc.returncode != 0 or not info:
        raise NbddpError(f"the run's supervisor could not start (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
    return int(info["pid"])


def main(argv: Sequence[str] | None = None) -> int:
    """The supervisor: fork away from the starter, then run the job and record how it ended."""
    paths = RunDir(Path((sys.argv[1:] if argv is None else argv)[0]))
    child = os.fork()
    if child:  # the starter's own child: say who the supervisor is, and go (the supervisor is re-parented)
        write_json(paths.supervisor, {"pid": child, "started": time.time()})
        return 0
    os.setsid()  # no terminal: no Ctrl-C or hang-up of the session that started it
    deadline = time.monotonic() + START_SECONDS
    while not paths.supervisor.exists() and time.monotonic() < deadline:  # the starter's child writes it first
        time.sleep(0.01)
    log = os.open(paths.supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((0, null), (1, log), (2, log)):
        os.dup2(target, fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered into the log
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        return _supervise(paths)
    except NbddpError as exc:  # refused before it started (devices, options): the attached door says why
        print(f"nbddp: error: {exc}", flush=True)
        _tell(paths, error=str(exc))
        return exc.exit_code


def _supervise(paths: RunDir) -> int:
    from nbddp.display.terminal import TerminalSink
    from nbddp.doors.cli import signals_interrupt
    from nbddp.doors.notebook_run import RunOptions, run_notebook
    from nbddp.job import orchestrator

    what = pickle.loads(paths.detached_request.read_bytes())

    def started(job: Any) -> None:  # what an attached door needs to show the job as its own run does
        _tell(paths, ranks=list(job.local_ranks()), launcher_log=job.launcher.streams_launcher_log)

    def say(text: str) -> None:  # (stdout and stderr are the transcript: supervisor.log)
        print(text, flush=True)

    with signals_interrupt():  # nbddp kill: SIGTERM, recorded as an interruption
        if isinstance(what, RunOptions):  # its terminal's transcript: what nbddp attach replays
            result = run_notebook(what, say=say, on_start=started)
        else:
            terminal = TerminalSink()
            result = orchestrator.run(what, orchestrator.NoKernel(WEIGHTS_WAIT), [terminal],
                                      lambda t: say(f"nbddp: {t}"), on_start=started)
            say(f"nbddp: {result.ending().line()}")
    return result.exit_code


def _tell(paths: RunDir, **facts: Any) -> None:
    write_json(paths.supervisor, {**(read_json(paths.supervisor) or {}), **facts})


def is_detached(run_dir: Path) -> bool:
    return RunDir(run_dir).supervisor.exists()


def find_run(which: str, cwd: Path) -> Path:
    """A detached run by its run dir (as a run prints it), its name under ``cwd/runs``, or a live run's name."""
    from nbddp.job.registry import find

    for candidate in (Path(which).expanduser(), Path(cwd) / "runs" / which):
        if candidate.is_dir():
            run_dir = candidate.resolve()
            break
    else:
        run_dir = Path(find(which).run_dir)  # (raises: no live run of that name)
    if not is_detached(run_dir):
        raise UsageError(f"{run_dir} is not a detached run: only runs started with --detach can be attached "
                         f"(its logs are in {RunDir(run_dir).logs}).")
    return run_dir


def latest(notebook: Path) -> Path:
    """The newest detached run of ``notebook`` (``runs/<stem>-*`` beside it): what ``--attach`` alone means."""
    runs = Path(notebook).resolve().parent / "runs"
    found = sorted((d for d in runs.glob(f"{Path(notebook).stem}-*") if is_detached(d)),
                   key=lambda d: d.stat().st_mtime) if runs.is_dir() else []
    if not found:
        raise UsageError(f"no detached run of {Path(notebook).name} in {runs}: start one with --detach, "
                         "or name the run dir to attach to.")
    return found[-1]


def follow(run_dir: Path, sinks: Sequence[Callable[[Any], None]], heartbeat: Callable[[], Any] | None = None,
           on_ranks: Callable[[list[int]], Any] | None = None) -> Any:
    """Stream the run's every line (the earlier ones first) until it ends; returns its ``RunRecord``.

    ``on_ranks(ranks)``: once the job's ranks are known (a view appears); ``heartbeat()``: on every poll
    (whatever it raises stops the following, not the run).

    Raises:
        UsageError: ``run_dir`` is not a detached run.
        RunFailed: the supervisor is gone without a result (it was killed), or refused the run.
    """
    from nbddp.job.follow import RunFollower
    from nbddp.job.rank_output import QuietStream
    from nbddp.job.record import RunRecord
    from nbddp.launchers.process_groups import process_alive
    from nbddp.notebook.sourcemap import SourceMap, sourcemap_path

    paths = RunDir(run_dir)
    _supervisor_info(paths)
    follower = quiet = None
    while True:
        info = read_json(paths.supervisor) or {}
        record = RunRecord.read(paths.path)
        if follower is None and ("ranks" in info or record is not None):
            ranks = info.get("ranks") or list(range(record.world_size))
            if on_ranks is not None:
                on_ranks(ranks)
            follower = RunFollower(paths.path, include_launcher=bool(info.get("launcher_log")))
            source_map = sourcemap_path(paths.script)
            quiet = QuietStream(SourceMap.load(source_map) if source_map.exists() else None, ranks)
        if follower is not None:
            for event in quiet.feed(list(follower.poll(final=record is not None)), final=record is not None):
                for sink in sinks:
                    sink(event)
        if record is not None:
            return record
        if info.get("error") or not process_alive(int(info.get("pid", 0))) and not paths.result.exists():
            raise _gone(paths, info)
        if heartbeat is not None:
            heartbeat()
        time.sleep(POLL_SECONDS)


def replay(run_dir: Path, write: Callable[[str], Any]) -> Any:
    """``write`` the supervisor's transcript (what ``nbddp run`` would have shown in its terminal: the
    ranks' lines, the notebook's cells, the ending), from its first line until the supervisor has
    ended; returns the run's ``RunRecord``.

    Raises:
        UsageError: ``run_dir`` is not a detached run.
        RunFailed: the supervisor is gone without a result (it was killed).
    """
    from nbddp.job.follow import Followed, read_complete
    from nbddp.job.record import RunRecord
    from nbddp.launchers.process_groups import process_alive

    paths = RunDir(run_dir)
    info = _supervisor_info(paths)
    transcript = Followed(paths.supervisor_log, None)
    while True:
        ended = not process_alive(int(info.get("pid", 0)))  # before the read: then that read is the last
        for line in read_complete(transcript, final=ended):
            write(line.decode("utf-8", errors="replace") + "\n")
        if ended:
            record = RunRecord.read(paths.path)
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
        return RunFailed(f"the detached run did not start: {info['error']}", run_dir=str(paths.path))
    return RunFailed(f"the detached run's supervisor (pid {info.get('pid')}) is gone and left no result: it was "
                     f"killed, and its ranks with it. Its last words: {paths.supervisor_log}", run_dir=str(paths.path))


def ending(record: Any, run_dir: Path, weights: str | None = None) -> Any:
    """The one line a followed run ends with, from its ``result.json``."""
    from nbddp.display.ending import NO_WEIGHTS, Ending, first_line

    weights = weights or NO_WEIGHTS
    return Ending(record.status, record.wall_time_s, Path(run_dir), weights, first_line(record.error or ""),
                  record.final_metrics, {int(rank): peak for rank, peak in record.peak_memory.items()})


def how_to_return(run_dir: Path, in_kernel: bool) -> str:
    """What a door says when it stops following: the run goes on, and how to reach it again."""
    from nbddp.display.ending import shown_path

    again = f"%ddp_attach {shown_path(run_dir)}" if in_kernel else f"nbddp attach {shown_path(run_dir)}"
    return f"the run goes on: `{again}` follows it again, `nbddp kill {shown_path(run_dir)}` stops it"


if __name__ == "__main__":
    sys.exit(main())
