"""Warm ranks (:mod:`nbddp.warm_pool`) seen as a launcher: the job is handed to ranks already running.

There is no launcher process per job and so no launcher report: each rank's own error report and
done mark (written as by a fresh rank) are the whole evidence, which :func:`nbddp.outcome.judge`
reads the same way.
"""

from __future__ import annotations

from nbddp.launchers import Launcher
from nbddp.rundir import RunDir


class WarmRanks(Launcher):
    name = "warm ranks"
    exit_settle = 0.5

    def report(self, run_dir: RunDir) -> str:
        return ""
