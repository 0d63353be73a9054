"""What every launcher is: :class:`Launcher` (starting a job's ranks, reading back what it saw of them),
:class:`Launch` (the started processes the job follows and stops) and :class:`LaunchReport` (what the
launcher observed, as data). Which launcher runs a job is chosen in :mod:`nbddp.launchers`.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from nbddp.contracts.devices import Devices
from nbddp.contracts.rundir import RunDir
from nbddp.launchers.local_process import LaunchSpec, LocalProcess
from nbddp.contracts.process_groups import STOP_GRACE

if TYPE_CHECKING:
    from nbddp.plan.job_spec import JobSpec

#: How many of the launcher's last lines a failure nothing else explains shows.
TAIL_LINES = 15


@dataclass(frozen=True)
class LaunchReport:
    """What a launcher observed of its job, once it has ended: read from the launcher's own report once
    (:meth:`Launcher.observe`), so the job judges data (:class:`nbddp.job.outcome.Evidence`), never text.
    As torch's elastic agent hands back ``RunResult(state, failures)`` rather than its log."""

    rank_exit_codes: dict[int, int] = field(default_factory=dict)
    """Per-rank exit codes the launcher saw (signals as ``-N``)."""
    root_cause: int | None = None
    """The rank the launcher names as the first failure, if it names one."""
    rendezvous_failure: str | None = None
    """Why the nodes of a multi-node run never all met, told as what the user must check."""
    scheduler_end: str | None = None
    """A scheduler's reason for ending the job (Slurm's time limit, an outside ``scancel``)."""
    tail: str = ""
    """The report's last :data:`TAIL_LINES` lines: shown when nothing else explains a failure."""


class Launch(Protocol):
    """A started job's processes, whatever started them: what :class:`~nbddp.job.lifecycle.Job` needs.

    Implemented by :class:`~nbddp.launchers.local_process.LocalProcess` (a launcher process in a
    group of its own), :class:`~nbddp.launchers.local_process.AdoptedGroup` (a group another process
    started) and :class:`~nbddp.launchers.warm.run.WarmRun` (one job on warm ranks).
    """

    pid: int
    pgid: int
    stopped_by: int | None
    """The signal nbddp stopped it with (``None``: it ended on its own)."""

    def poll(self) -> int | None:
        """The exit code once it ended, else ``None``."""

    def alive(self) -> bool:
        """True while any of its processes runs."""

    def stop(self, sig: int = signal.SIGTERM, grace: float | None = None, reap: bool = False) -> None:
        """``sig``, then SIGKILL after ``grace`` seconds; ``reap``: only clear what an ended launcher left."""


class Launcher:
    """What every launcher answers; the defaults are those of a launcher process on this machine."""

    name = "launcher"
    supports_restarts = False
    """Whether ``--max-restarts`` can be honoured (torchrun restarts ranks; a spawn can't)."""
    streams_launcher_log = False
    """Whether the launcher's own output belongs in the live stream (a spawn's children print there)."""
    stop_grace = STOP_GRACE
    """Seconds between SIGTERM and SIGKILL when nbddp stops the launcher (Slurm needs time to cancel)."""
    exit_settle = 1.0
    """Seconds a rank seen gone is given for the launcher to exit with a better report (a crash torchrun
    saw; a job Slurm itself cancelled) before nbddp blames the rank for leaving early."""

    @classmethod
    def for_job(cls, spec: "JobSpec") -> "Launcher":
        """The launcher of ``spec``'s job (:func:`launcher_for` calls this on the chosen class)."""
        return cls()

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        """The argv that starts every rank of the job."""
        raise NotImplementedError

    def environment(self, run_dir: RunDir) -> dict[str, str]:
        """Variables the ranks need beyond :class:`nbddp.contracts.rank_env.RankEnv`'s common ones (a run on one
        machine: where its ranks meet, :mod:`nbddp.launchers.private_rendezvous`)."""
        return {}

    def start(self, script: Path, spec: "JobSpec", rank_env: dict[str, str]) -> Launch:
        """Start every rank of the job: its launcher process in a group of its own, output to the run dir.

        ``rank_env``: the ``NBDDP_*`` variables of this run (:class:`~nbddp.contracts.rank_env.RankEnv`).
        """
        paths = spec.run_dir
        env = {**os.environ, **rank_env, **self.environment(paths)}
        argv = self.command(script, spec.devices, paths, python=spec.python, max_restarts=spec.launch.max_restarts)
        return LocalProcess(LaunchSpec(tuple(argv), env, spec.cwd, paths.launcher_log, self.stop_grace))

    def observe(self, run_dir: RunDir, expired: bool = False) -> LaunchReport:
        """What this launcher saw of the job in ``run_dir``, read from its report once (``expired``: nbddp
        stopped waiting for the nodes to meet after ``--rdzv-timeout``). A launcher reads its own report
        with the steps below; the job only ever sees this."""
        report = self.report(run_dir)
        return LaunchReport(rank_exit_codes=self.rank_exit_codes(report), root_cause=self.root_cause(report),
                            rendezvous_failure=self.rendezvous_failure(report, expired),
                            scheduler_end=self.ended_by_scheduler(run_dir),
                            tail="\n".join(report.splitlines()[-TAIL_LINES:]))

    def report(self, run_dir: RunDir) -> str:
        """The launcher's own output, where its failure reports are."""
        return read_report(run_dir.launcher_log)

    def rank_exit_codes(self, report: str) -> dict[int, int]:
        """Per-rank exit codes from the launcher's failure report (signals as ``-N``)."""
        return {}

    def root_cause(self, report: str) -> int | None:
        """The rank the launcher names as the first failure, if it names one."""
        return None

    def failed_attempt(self, report: str) -> str | None:
        """Why the launcher last restarted the ranks, in its words (``--max-restarts``), if it says."""
        return None

    def rendezvous_failure(self, report: str, expired: bool = False) -> str | None:
        """Why the nodes of a multi-node run never all met, when that is what happened
        (``expired``: nbddp stopped waiting for them after ``--rdzv-timeout``)."""
        return None

    def ended_by_scheduler(self, run_dir: RunDir) -> str | None:
        """A scheduler's reason for ending the job (Slurm's time limit, an outside scancel…)."""
        return None

    job_record: str | None = None
    """The ``result.json`` field :meth:`job_info` goes into (``None``: no scheduler's job to record)."""

    def job_info(self, run_dir: RunDir) -> dict | None:
        """What ``result.json`` records about a scheduler's job (its id, state, nodes)."""
        return None

    def between_attempts(self, run_dir: RunDir, attempt: int) -> bool:
        """The ranks of ``attempt`` are gone because the job is being run again (a Slurm requeue), not
        because one of them left early."""
        return False


def read_report(path: Path) -> str:
    """A launcher's log (``""`` when it wrote none)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
