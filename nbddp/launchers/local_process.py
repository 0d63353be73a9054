"""Start the job's processes and own their shutdown.

The launcher (torchrun, or the script itself for Catalyst) runs in a new
session, so it and every rank share one process group that nbddp owns: a
Ctrl-C in the terminal reaches only nbddp, which then stops the whole group
SIGTERM → deadline → SIGKILL. Nothing here installs a signal handler (this
also runs inside a Jupyter kernel). Output goes to a file, never a pipe that
could fill up and block the launcher. The launcher is started through
:mod:`nbddp.rank_side.parent_death`, so it (and through it every rank) dies with this process
even when this process is killed without a chance to clean up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from nbddp.contracts.process_groups import STOP_GRACE, group_alive, process_alive, stop_groups
from nbddp.contracts.interpreter import module_argv


@dataclass(frozen=True)
class LaunchSpec:
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: Path
    log_path: Path
    grace: float = STOP_GRACE
    """Seconds between SIGTERM and SIGKILL when stopping (a Slurm watcher needs time to cancel its job)."""
    arms_itself: bool = False
    """The command arms its own parent-death signal first thing, and checks its parent (a warm pool's starter
    started ahead, whose start is on the first run's path): it is started without the wrapper (0.15 s)."""


class LocalProcess:
    """A launcher process started here, in a group of its own: poll it, wait for it, stop it
    (a :class:`nbddp.launchers.Launch`). Use as a context manager to never leak it."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        guarded = list(spec.argv) if spec.arms_itself else module_argv(
            "nbddp.rank_side.parent_death", str(os.getpid()), "--", *spec.argv)
        with open(spec.log_path, "ab") as log:
            self.process = subprocess.Popen(
                guarded, cwd=spec.cwd, env=spec.env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.pgid = self.process.pid
        self.started = time.monotonic()
        self.stopped_by: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        """Exit code, or ``None`` if still running after ``timeout`` seconds."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, sig: int = signal.SIGTERM, grace: float | None = None, reap: bool = False) -> None:
        """Signal the whole group, give it ``grace`` seconds (the spec's by default), then SIGKILL what is left.

        ``reap``: the launcher already ended and this only clears processes it left behind
        (spawned children still exiting): that doesn't make the run "stopped by nbddp".
        """
        if self.stopped_by is None and not reap:
            self.stopped_by = sig
        stop_groups([self.pgid], sig, self.spec.grace if grace is None else grace, reap=self.process.poll)

    def alive(self) -> bool:
        """True while any process of the group is running (zombies of ours reaped first)."""
        self.process.poll()
        return group_alive(self.pgid)

    def __enter__(self) -> "LocalProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.poll() is None or self.alive():
            self.stop()


class AdoptedGroup:
    """A launcher process another process started (a batch's warm pool, adopted by one of its runs):
    polled and stopped by its pid and process group (a :class:`nbddp.launchers.Launch`)."""

    def __init__(self, pid: int, pgid: int) -> None:
        self.pid, self.pgid = pid, pgid
        self.stopped_by: int | None = None

    def poll(self) -> int | None:
        return None if process_alive(self.pid) else 1  # not our child: its exit code is the owner's to read

    def alive(self) -> bool:
        return group_alive(self.pgid)

    def stop(self, sig: int = signal.SIGTERM, grace: float | None = None, reap: bool = False) -> None:
        if self.stopped_by is None and not reap:
            self.stopped_by = sig
        stop_groups([self.pgid], sig, STOP_GRACE if grace is None else grace)
