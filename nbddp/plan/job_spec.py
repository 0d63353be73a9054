"""What a job is asked to run, where and on what: the plan a launcher reads.

A plain frozen value, built by :mod:`nbddp.job.orchestrator` from the script, the devices and the launch
options, read by the launchers (:func:`nbddp.launchers.launcher_for`, :meth:`~nbddp.launchers.Launcher.start`)
and followed by :class:`nbddp.job.lifecycle.Job`. It sits in the plan's layer, below the launchers
that read it, so that they need nothing of the job that runs them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbddp.contracts.devices import Devices
from nbddp.notebook.script import Script
from nbddp.plan.options import LaunchOptions


@dataclass(frozen=True)
class JobSpec:
    """What to run, where, on what: everything a job needs before it starts."""

    script: Script
    devices: Devices
    run_dir: Path
    cwd: Path
    python: str = sys.executable
    launch: LaunchOptions = LaunchOptions()
    """The options the job runs with (its collective timeout, restarts, nodes, Slurm or Ray request…)."""
    owner: str = "cli"
    """``cli`` (an ``nbddp run`` process) or ``kernel`` (``%%ddp_train``): how ``nbddp kill`` stops it."""
    pool: Any = None
    """Warm ranks (:class:`nbddp.launchers.warm.pool.WarmPool`) to hand the job to, instead of starting ranks."""

    @property
    def node_count(self) -> int:
        launch = self.launch
        cluster = launch.slurm or launch.ray
        return launch.nodes.count if launch.nodes else cluster.nodes if cluster else 1

    @property
    def world_size(self) -> int:
        return self.devices.nproc * self.node_count

