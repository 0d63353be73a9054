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

from nbddp.devices import Devices
from nbddp.notebook.script import Script
from nbddp.options import DEFAULT_COLLECTIVE_TIMEOUT, DEFAULT_RDZV_TIMEOUT, Nodes, RayRequest, SlurmRequest


@dataclass(frozen=True)
class JobSpec:
    """What to run, where, on what: everything a job needs before it starts."""

    script: Script
    devices: Devices
    run_dir: Path
    cwd: Path
    python: str = sys.executable
    collective_timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT
    owner: str = "cli"
    """``cli`` (an ``nbddp run`` process) or ``kernel`` (``%%ddp_train``): how ``nbddp kill`` stops it."""
    max_restarts: int = 0
    nodes: Nodes | None = None
    """This node's part in a multi-node run."""
    slurm: SlurmRequest | None = None
    """The Slurm job the ranks run as (``None``: here)."""
    ray: RayRequest | None = None
    """The Ray cluster whose workers run the ranks (``None``: here)."""
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT
    pool: Any = None
    """Warm ranks (:class:`nbddp.launchers.warm_pool.WarmPool`) to hand the job to, instead of starting ranks."""

    @property
    def node_count(self) -> int:
        cluster = self.slurm or self.ray
        return self.nodes.count if self.nodes else cluster.nodes if cluster else 1

    @property
    def world_size(self) -> int:
        return self.devices.nproc * self.node_count

