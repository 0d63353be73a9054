"""Warm ranks as a launcher: the job is handed to ranks already running (:mod:`nbddp.launchers.warm.pool`).

There is no launcher process per job: :meth:`WarmRanks.start` writes the job for the pool's ranks
and returns a :class:`~nbddp.launchers.warm.pool.WarmRun` the job follows like any launch. The
ranks' own error reports and done marks (written as by a fresh rank) are the evidence, which
:func:`nbddp.job.outcome.judge` reads the same way; should a rank die, the pool's starter reports
it (its ``logs/launch.json``), read here as a fresh run's is.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from nbddp.launchers.base import Launch, read_report
from nbddp.launchers.direct import Direct
from nbddp.launchers.warm.pool import WarmPool
from nbddp.contracts.rundir import RunDir

if TYPE_CHECKING:
    from nbddp.plan.job_spec import JobSpec


class WarmRanks(Direct):
    name = "warm"
    supports_restarts = False
    exit_settle = 5.0
    """A warm rank that died takes the pool's starter down with a report naming it; wait for that
    report rather than blame a rank the starter itself stopped in response."""

    def __init__(self, pool: WarmPool) -> None:
        super().__init__()
        self.pool = pool

    @classmethod
    def for_job(cls, spec: JobSpec) -> "WarmRanks":
        return cls(spec.pool)

    def start(self, script: Path, spec: JobSpec, rank_env: dict[str, str]) -> Launch:
        return self.pool.submit(script, rank_env, spec.cwd)

    def report(self, run_dir: RunDir) -> str:
        return read_report(self.pool.dir.launcher_log)

    def launch_report(self, run_dir: RunDir) -> Path:
        return self.pool.dir.launch_report
