"""One DDP job: write the script into a run dir, launch it, follow it, judge it.

Used by ``nbddp run`` (with a kernel beside it) and by the ``%%ddp_train``
magic (inside the kernel). The outcome never trusts an exit status alone:
a job stopped by nbddp is *interrupted* or *timed out* even when Catalyst's
children exit 0 after a signal, and a zero exit without the checkpoint the
job promised is a failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from nbddp import registry
from nbddp.devices import Devices
from nbddp.engines import catalyst as catalyst_engine
from nbddp.engines import torch as torch_engine
from nbddp.errors import NbddpError, UsageError
from nbddp.launch import Launch, LaunchSpec, rank_environment
from nbddp.procs import process_alive
from nbddp.report import (RankError, RunRecord, describe_exit, launcher_exit_codes, launcher_root_cause,
                          last_metrics, rank_errors)
from nbddp.script import Script, write_script
from nbddp.stream import RunFollower, Sink

POLL_SECONDS = 0.05
RANK_CHECK_SECONDS = 0.5
#: ``--collective-timeout`` default: long enough for a slow epoch's all-reduce, far below torch's 30 min.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
#: gloo's "Timed out waiting Nms for recv", NCCL's watchdog; not "timed out connecting" (a start-up failure).
_COLLECTIVE_TIMEOUT = re.compile(r"timed out waiting|collective operation timeout|watchdog caught", re.IGNORECASE)
#: What a rank reports when a *peer* vanished: the peer, not this rank, is the root cause.
_PEER_GONE = re.compile(r"closed by peer|reset by peer|broken pipe|connection (?:closed|reset|refused)", re.IGNORECASE)
#: Exit codes for outcomes, as shells and CI read them.
EXIT_CODES = {"succeeded": 0, "failed": 1, "timeout": 124, "interrupted": 130}


def create_run_dir(notebook: Path, run_dir: Path | None = None) -> Path:
    """``runs/<stem>-<timestamp>`` beside the notebook, unique even within one second, private."""
    if run_dir is not None:
        run_dir = Path(run_dir)
        if any((run_dir / name).exists() for name in ("result.json", "train.py", "logs")):
            raise UsageError(f"--run-dir {run_dir} already holds a run. Choose a new folder (runs are never overwritten).")
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return run_dir.resolve()
    parent = notebook.resolve().parent / "runs"
    parent.mkdir(exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1, 10_000):
        candidate = parent / (f"{notebook.stem}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            candidate.mkdir(mode=0o700)  # atomic: two runs in the same second get different dirs
            return candidate
        except FileExistsError:
            continue
    raise NbddpError(f"could not create a run dir in {parent}.")


@dataclass
class JobOutcome:
    status: str
    """``succeeded``, ``failed``, ``timeout`` or ``interrupted``."""
    exit_code: int
    launcher_exit: int | None
    rank_exit_codes: dict[int, int] = field(default_factory=dict)
    errors: list[RankError] = field(default_factory=list)
    message: str = ""
    final_metrics: dict[str, Any] = field(default_factory=dict)


class Job:
    """A launched job. Always ends through :meth:`wait` or :meth:`stop` (use ``with``)."""

    def __init__(self, script: Script, devices: Devices, run_dir: Path, cwd: Path,
                 python: str = sys.executable, collective_timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT,
                 owner: str = "cli", max_restarts: int = 0) -> None:
        self.script = script
        self.devices = devices
        self.run_dir = run_dir
        self.script_path, _ = write_script(script, run_dir / script.source_map.script)
        self.checkpoint = run_dir / "weights.pt"
        (run_dir / "logs").mkdir(exist_ok=True)
        engine = catalyst_engine if script.engine == "catalyst" else torch_engine
        if max_restarts and script.engine != "torch":
            raise UsageError("--max-restarts needs the torch engine (torchrun restarts ranks; Catalyst's spawn can't).")
        argv = engine.launch_command(str(self.script_path), devices.nproc, python=python, max_restarts=max_restarts,
                                     log_dir=str(run_dir / "logs" / "torchrun"))
        env = rank_environment(os.environ, run_dir=run_dir, device_kind=devices.kind,
                               nproc=devices.nproc, checkpoint=self.checkpoint)
        self.collective_timeout = collective_timeout
        if collective_timeout:
            env["NBDDP_COLLECTIVE_TIMEOUT"] = str(collective_timeout)
        self.early_exit: int | None = None
        self.idle_for: float | None = None
        self.started_at = time.time()
        self.launch = Launch(LaunchSpec(tuple(argv), env, cwd, run_dir / "logs" / "launcher.log"))
        self.live = registry.register(run_dir, self.launch.pgid, script.engine, devices.nproc, owner)
        self.follower = RunFollower(run_dir, include_launcher=script.engine == "catalyst")

    def pump(self, sinks: Sequence[Sink], final: bool = False) -> bool:
        """Deliver what the ranks wrote since the last call.

        All files are read before any sink runs: a slow sink (a plot being drawn) must not
        stretch the moments at which different ranks' files are read, or their lines interleave badly.
        """
        events = list(self.follower.poll(final=final))
        for event in events:
            for sink in sinks:
                sink(event)
        return bool(events)

    def wait(self, sinks: Sequence[Sink], deadline: float | None = None,
             idle_timeout: float | None = None) -> JobOutcome:
        """Stream until the job ends, then judge it. Stops every rank first when:

        * the monotonic ``deadline`` passes (``--timeout``),
        * no rank printed or logged anything for ``idle_timeout`` seconds (``--idle-timeout``),
        * a rank ended without finishing while the others still run (it would leave them
          waiting in a collective: a hang, not a failure, under NCCL),
        * or anything is raised here (KeyboardInterrupt included), which then propagates.
        """
        last_activity = last_check = time.monotonic()
        timed_out = False
        try:
            while self.launch.poll() is None:
                now = time.monotonic()
                if self.pump(sinks):
                    last_activity = now
                if deadline is not None and now > deadline:
                    timed_out = True
                elif idle_timeout and now - last_activity > idle_timeout:
                    self.idle_for, timed_out = idle_timeout, True
                elif now - last_check > RANK_CHECK_SECONDS:
                    last_check = now
                    self.early_exit = self._rank_ended_early()
                if timed_out or self.early_exit is not None:
                    self.launch.stop(signal.SIGTERM)
                    break
                time.sleep(POLL_SECONDS)
        except BaseException:
            self.launch.stop(signal.SIGTERM)
            self.pump(sinks, final=True)
            raise
        if self.launch.stopped_by is None and self.launch.alive():
            self.launch.stop(signal.SIGTERM, reap=True)  # the launcher left stragglers behind
        self.pump(sinks, final=True)
        return self.outcome(timed_out=timed_out)

    def _rank_ended_early(self, despite_errors: bool = False, live: bool = True) -> int | None:
        """A rank whose process is gone with neither a 'done' mark nor an error report.

        While any rank has reported an error, a rank killed by the launcher in response looks
        the same, so nobody is blamed unless ``despite_errors`` (the error says a peer vanished).
        ``live``: called while the job runs, so a launcher exiting meanwhile defers to its report.
        """
        if not despite_errors and any((self.run_dir / "errors").glob("rank-*.json")):
            return None  # (after a restart too: stale reports make this check conservative)
        ranks = self.run_dir / "ranks"
        for info in ranks.glob("rank-*.json") if ranks.is_dir() else ():
            rank = int(info.stem.split("-")[1])
            if (ranks / f"rank-{rank}.done").exists() or (self.run_dir / "errors" / f"rank-{rank}.json").exists():
                continue
            try:
                pid = json.loads(info.read_text())["pid"]
            except (OSError, ValueError, KeyError):
                continue
            if not process_alive(pid):
                # Its error report or done mark may be a moment behind its exit; and a launcher that
                # saw it die (a signal, a crash) exits within its monitor interval with a better report.
                deadline = time.monotonic() + 1.0
                while time.monotonic() < deadline:
                    if (live and self.launch.poll() is not None) or (ranks / f"rank-{rank}.done").exists() \
                            or (self.run_dir / "errors" / f"rank-{rank}.json").exists():
                        return None
                    time.sleep(0.05)
                return rank
        return None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.launch.stop(sig)

    def restarts(self) -> int:
        """torchrun's restart count of the latest attempt (from the ranks' own reports)."""
        attempts = [0]
        for info in (self.run_dir / "ranks").glob("rank-*.json"):
            try:
                attempts.append(int(json.loads(info.read_text()).get("attempt", 0)))
            except (OSError, ValueError):
                continue
        return max(attempts)

    def outcome(self, timed_out: bool = False, interrupted_by: int | None = None) -> JobOutcome:
        code = self.launch.poll()
        latest = self.restarts()  # errors of attempts torchrun recovered from don't count
        errors = [e for e in rank_errors(self.run_dir, self.script.source_map) if e.attempt >= latest]
        codes = launcher_exit_codes(self.launch.spec.log_path)
        for error in errors:
            codes.setdefault(error.rank, 1)
        metrics = last_metrics(self.run_dir)
        if interrupted_by is None and not timed_out and (self.run_dir / registry.STOP_MARK).exists():
            return JobOutcome("interrupted", 128 + signal.SIGTERM, code, codes, errors,
                              "stopped by `nbddp kill`; every rank was stopped.", metrics)
        peer_gone = bool(errors) and bool(_PEER_GONE.search(errors[0].message))
        we_stopped = self.launch.stopped_by is not None
        # SIGTERMs come from whoever stops the survivors (torchrun, spawn, or us): never the root cause.
        signalled = {r: c for r, c in codes.items() if c < 0 and c != -signal.SIGTERM}
        if signalled and (not errors or peer_gone) and not timed_out and interrupted_by is None \
                and (not we_stopped or self.early_exit is not None):
            root = launcher_root_cause(self.launch.spec.log_path)
            rank = root if root in signalled else min(signalled)
            return JobOutcome("failed", 1, code, codes, errors, self._death_message(rank, signalled[rank]), metrics)
        if self.early_exit is None and peer_gone:
            self.early_exit = self._rank_ended_early(despite_errors=True, live=False)
        if self.early_exit is not None:
            rank = self.early_exit
            return JobOutcome("failed", 1, code, codes, errors, (
                f"rank {rank} ended before the training finished, without an error, while the other ranks "
                f"were still running (they would have waited for it in a collective). Look for sys.exit(), "
                f"os._exit() or a return path that skips work on some ranks; its log: "
                f"{self.run_dir / 'logs' / f'rank-{rank}.log'}"), metrics)
        interrupted_by = interrupted_by or (self.launch.stopped_by if not timed_out else None)
        if timed_out:
            message = (f"no rank printed or logged anything for {self.idle_for:g}s (--idle-timeout): stopped. "
                       "A stuck data loader or a deadlock outside collectives?") if self.idle_for else \
                "the run exceeded --timeout; every rank was stopped."
            return JobOutcome("timeout", 124, code, codes, errors, message, metrics)
        if errors and _COLLECTIVE_TIMEOUT.search(errors[0].message) and errors[0].type in (
                "RuntimeError", "DistBackendError", "DistError", "DistStoreError", "DistNetworkError"):
            return JobOutcome("timeout", 124, code, codes, errors, (
                f"a collective timed out (--collective-timeout {self.collective_timeout:g}s): rank "
                f"{errors[0].rank} waited for peers that never joined — did a rank skip an all_reduce, "
                f"or stall?\n\n" + self._failure_message(code, errors, codes)), metrics)
        if interrupted_by is not None:
            status_code = 128 + interrupted_by
            return JobOutcome("interrupted", status_code, code, codes, errors,
                              f"interrupted by {signal.Signals(interrupted_by).name}; every rank was stopped.", metrics)
        if code == 0 and self.checkpoint.exists() and not errors:
            codes = {r: 0 for r in range(self.devices.nproc)} | codes
            return JobOutcome("succeeded", 0, code, codes, [], "", metrics)
        message = self._failure_message(code, errors, codes)
        # Bad input found by the launcher before any rank started (Catalyst's pickling check): exit 2.
        bad_input = not errors and "UnpicklableError:" in message
        return JobOutcome("failed", 2 if bad_input else 1, code, codes, errors, message, metrics)

    def _failure_message(self, code: int | None, errors: list[RankError], codes: dict[int, int]) -> str:
        notebook = self.script.source_map.notebook
        if errors:
            first = errors[0]
            return (f"{first.headline(notebook)}\n\nTraceback (notebook cells in brackets):\n"
                    f"{first.traceback.rstrip()}\n\nFull log: {self.run_dir / 'logs' / f'rank-{first.rank}.log'}")
        dead = {r: c for r, c in codes.items() if c != 0}
        if dead:
            return self._death_message(*min(dead.items(), key=lambda rc: rc[0]))
        if code == 0:
            return (f"the ranks exited without saving the returned weights ({self.checkpoint.name}). "
                    "A rank may have exited early; see the logs in " + str(self.run_dir / "logs"))
        tail = _tail(self.launch.spec.log_path)
        raised = [line for line in tail.splitlines() if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*:", line)]
        headline = f"{raised[-1]}\n\n" if raised else ""
        return f"{headline}the launcher failed ({describe_exit(code or 1)}); its last output:\n{tail}"

    def _death_message(self, rank: int, exit_code: int) -> str:
        """A rank that ended badly; told truthfully when it had finished its training first."""
        log = self.run_dir / "logs" / f"rank-{rank}.log"
        if not (self.run_dir / "ranks" / f"rank-{rank}.done").exists():
            return f"rank {rank} died: {describe_exit(exit_code)}. Its last output is in {log}."
        how = signal.Signals(-exit_code).name if exit_code < 0 and -exit_code in signal.valid_signals() \
            else describe_exit(exit_code)
        kept = f"The trained weights are kept in {self.checkpoint}. " if self.checkpoint.exists() else ""
        return (f"rank {rank} finished training, then crashed while exiting ({how}): a defect in the process's "
                f"teardown, not in the training. {kept}Its last output is in {log}.")

    def record(self, status: str, exit_code: int, message: str, outcome: JobOutcome | None,
               parameters: dict[str, Any], notebook: str, overrides: dict[str, Any] | None = None,
               command: str = "") -> RunRecord:
        """``result.json`` for this job, written into the run dir and returned.

        ``parameters``: every value the run used; ``overrides``: those given on top of the defaults.
        """
        ended = time.time()
        record = RunRecord(
            status=status, exit_code=exit_code, notebook=notebook, engine=self.script.engine,
            devices={"kind": self.devices.kind, "nproc": self.devices.nproc}, world_size=self.devices.nproc,
            parameters=dict(parameters), started_at=self.started_at, ended_at=ended,
            wall_time_s=round(ended - self.started_at, 3),
            rank_exit_codes={str(k): v for k, v in (outcome.rank_exit_codes if outcome else {}).items()},
            final_metrics=outcome.final_metrics if outcome else last_metrics(self.run_dir),
            restarts=self.restarts(),
            checkpoint=str(self.checkpoint) if self.checkpoint.exists() else None,
            error=message or None, script=str(self.script_path), overrides=dict(overrides or {}), command=command,
        )
        record.write(self.run_dir)
        return record

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        if self.launch.poll() is None or self.launch.alive():
            self.launch.stop()
        registry.unregister(self.live)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=repr), encoding="utf-8")
