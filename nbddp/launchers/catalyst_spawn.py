"""The Catalyst engine's launcher: the script itself, whose DDP engine spawns the ranks (``mp.spawn``).

The world size and, across nodes, the topology travel in the ranks' environment
(:class:`nbddp.contracts.rank_env.RankEnv`): Catalyst's
``DistributedDataParallelEngine`` takes them as its ``world_size``, ``workers_dist_rank`` and
``address``/``port``. The ranks' exit codes come from the spawn's own error report.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from nbddp.contracts.devices import Devices
from nbddp.launchers import private_rendezvous
from nbddp.launchers.base import Launcher
from nbddp.launchers.torchrun import rendezvous_failure
from nbddp.plan.options import DEFAULT_RDZV_TIMEOUT, Nodes
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.rank_env import RankEnv
from nbddp.contracts.interpreter import program_argv

if TYPE_CHECKING:
    from nbddp.plan.job_spec import JobSpec

_FAILURE = re.compile(r"process (\d+) terminated with (?:exit code (-?\d+)|signal (SIG\w+))", re.I)
_RAISED = re.compile(r"-- Process (\d+) terminated with the following error")


class CatalystSpawn(Launcher):
    name = "catalyst-spawn"
    streams_launcher_log = True

    def __init__(self, nodes: Nodes | None = None, rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT) -> None:
        self.nodes, self.rdzv_timeout = nodes, rdzv_timeout
        self.first_rank = 0

    @classmethod
    def for_job(cls, spec: JobSpec) -> "CatalystSpawn":
        return cls(spec.launch.nodes, spec.launch.rdzv_timeout)

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        self.first_rank = self.nodes.rank * devices.nproc if self.nodes else 0
        return program_argv([str(script)], python=python)  # (its spawned ranks start as it did: -P)

    def environment(self, run_dir: RunDir) -> dict[str, str]:
        if self.nodes is None:  # Catalyst's spawned ranks meet in a file (file://) of the run's store folder
            return private_rendezvous.environment(private_rendezvous.prepare(run_dir.store))
        return RankEnv(nnodes=self.nodes.count, node_rank=self.nodes.rank, master=self.nodes.endpoint,
                       rdzv_timeout=self.rdzv_timeout).variables()

    def rank_exit_codes(self, report: str) -> dict[int, int]:
        """Spawn numbers its processes per node: on node R, process i is global rank ``R * nproc + i``."""
        codes: dict[int, int] = {}
        for index, code, sig in _FAILURE.findall(report):
            codes[self.first_rank + int(index)] = int(code) if code else -int(getattr(signal, sig, 0))
        for index in _RAISED.findall(report):
            codes.setdefault(self.first_rank + int(index), 1)
        return codes

    def rendezvous_failure(self, report: str, expired: bool = False) -> str | None:
        return rendezvous_failure(report, self.nodes, self.rdzv_timeout, expired)
