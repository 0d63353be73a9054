"""What a job is asked to run, where and on what: the plan a launcher reads.

A plain frozen value, built by :mod:`nbddp.job.orchestrator` from the script, the devices and the launch
options, read by the launchers (:func:`nbddp.launchers.launcher_for`, :meth:`~nbddp.launchers.Launcher.start`)
and followed by :class:`nbddp.job.lifecycle.Job`. It sits in the plan's layer, below the launchers
that read it, so that they need nothing of the job that runs them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

from nbddp.contracts.devices import Devices
from nbddp.contracts.pool_dir import PoolDir
from nbddp.contracts.rundir import RunDir
from nbddp.notebook.script import Script
from nbddp.plan.options import LaunchOptions


class WarmHandle(Protocol):
    """Warm ranks a job can be handed to instead of starting its own (:class:`nbddp.launchers.warm.pool.WarmPool`
    is one): what the warm launcher asks of them. The job only carries them from its door's warm source
    (:class:`nbddp.job.orchestrator.WarmSource`) to that launcher."""

    dir: PoolDir
    """The pool's folder: its starter's log and launch report."""

    def submit(self, script: Path, rank_env: Mapping[str, str], cwd: Path) -> Any:
        """Hand the ranks the job; the handle returned is its :class:`nbddp.launchers.base.Launch` (a layer above)."""


@dataclass(frozen=True)
class JobSpec:
    """What to run, where, on what: everything a job needs before it starts."""

    script: Script
    devices: Devices
    run_dir: RunDir
    """The run's folder, its files named by :class:`~nbddp.contracts.rundir.RunDir` (created, private)."""
    cwd: Path
    python: str = sys.executable
    launch: LaunchOptions = LaunchOptions()
    """The options the job runs with (its collective timeout, restarts, nodes, Slurm or Ray request…)."""
    owner: str = "cli"
    """``cli`` (an ``nbddp run`` process) or ``kernel`` (``%%ddp_train``): how ``nbddp kill`` stops it."""
    pool: WarmHandle | None = None
    """Warm ranks to hand the job to, instead of starting ranks."""
    environment: Mapping[str, str] = field(default_factory=dict)
    """Variables the ranks get beside nbddp's own: where rank 0's experiment records go (:mod:`nbddp.job.trackers`)."""

    @property
    def node_count(self) -> int:
        launch = self.launch
        cluster = launch.slurm or launch.ray
        return launch.nodes.count if launch.nodes else cluster.nodes if cluster else 1

    @property
    def world_size(self) -> int:
        return self.devices.nproc * self.node_count

