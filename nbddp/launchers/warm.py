"""Warm ranks (:mod:`nbddp.launchers.warm_pool`) seen as a launcher: the job is handed to ranks already running.

There is no launcher process per job. The ranks' own error reports and done marks (written as by
a fresh rank) are the evidence, which :func:`nbddp.job.outcome.judge` reads the same way; should a rank
die, the pool's torchrun reports it in the pool's log, read here with torchrun's own parsers.
"""

from __future__ import annotations

from pathlib import Path

from nbddp.launchers import _read
from nbddp.launchers.torchrun import Torchrun
from nbddp.job.rundir import RunDir


class WarmRanks(Torchrun):
    name = "warm ranks"
    supports_restarts = False
    exit_settle = 5.0
    """A warm rank that died takes the pool's torchrun down with a report naming it; wait for that
    report rather than blame a rank torchrun itself stopped in response."""

    def __init__(self, pool_folder: Path) -> None:
        super().__init__()
        self.pool_log = RunDir(pool_folder).launcher_log

    def report(self, run_dir: RunDir) -> str:
        return _read(self.pool_log)
