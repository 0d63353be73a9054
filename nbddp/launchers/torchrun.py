"""``torch.distributed.run`` (torchrun): the torch engine's launcher, on one machine or one node of several.

torchrun's command line is the torch engine's (:func:`nbddp.engines.torch.torchrun_options`): this
launcher's argv, a Slurm job's task line and an exported script's header are renderings of it. Here:
starting it, and reading its failure report back (per-rank exit codes, the root cause, a rendezvous
that never completed).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from nbddp.contracts.devices import Devices
from nbddp.engines.torch import torchrun_options
from nbddp.launchers import private_rendezvous
from nbddp.launchers.base import Launcher
from nbddp.plan.options import DEFAULT_RDZV_TIMEOUT, Nodes
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.interpreter import module_argv

if TYPE_CHECKING:
    from nbddp.plan.job_spec import JobSpec

#: What nbddp's launcher runs: torchrun's own ``main``, minus the collection at its exit
#: (:mod:`nbddp.launchers.torchrun_main`); the same options, the same behaviour.
LAUNCHER_MODULE = "nbddp.launchers.torchrun_main"
_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_ATTEMPT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_NODES_MISSING = re.compile(r"waiting for clients\. (\d+)/(\d+) clients joined")
_NO_HOST = re.compile(r"timed out after \d+ms while trying to connect to \(([^,]+), (\d+)\)")
_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


class Torchrun(Launcher):
    name = "torchrun"
    supports_restarts = True

    def __init__(self, nodes: Nodes | None = None, rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT) -> None:
        self.nodes, self.rdzv_timeout = nodes, rdzv_timeout

    @classmethod
    def for_job(cls, spec: JobSpec) -> "Torchrun":
        return cls(spec.launch.nodes, spec.launch.rdzv_timeout)

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        """torchrun in its own process, never ``elastic_launch`` inside the kernel (it replaces the
        kernel's SIGINT handler)."""
        return module_argv(LAUNCHER_MODULE, *self.options(devices.nproc, max_restarts, str(run_dir.torchrun_logs),
                                                          str(run_dir.store)), str(script), python=python)

    def environment(self, run_dir: RunDir) -> dict[str, str]:
        if self.nodes is not None:
            return {}
        return private_rendezvous.environment(private_rendezvous.prepare(run_dir.store))

    def options(self, nproc: int, max_restarts: int = 0, log_dir: str | None = None,
                store: str | None = None) -> list[str]:
        """This launcher's torchrun options (this node's part, when there are several); ``store``: where the
        ranks of a run on one machine meet."""
        if self.nodes is None:
            return torchrun_options(nproc, max_restarts=max_restarts, monitor=True, log_dir=log_dir, store=store)
        return torchrun_options(nproc, nnodes=self.nodes.count, node_rank=self.nodes.rank,
                                endpoint=self.nodes.endpoint, rdzv_timeout=self.rdzv_timeout,
                                max_restarts=max_restarts, monitor=True, log_dir=log_dir)

    def rank_exit_codes(self, report: str) -> dict[int, int]:
        return {int(rank): int(code) for rank, code in _FAILURE.findall(report)}

    def failed_attempt(self, report: str) -> str | None:
        """torchrun's agent logs each failed attempt before it restarts the ranks ("failed (exitcode: 17)
        local_rank: 1 (pid: …)"): the last one, as ``local rank 1 exited with code 17``."""
        found = _ATTEMPT_FAILED.findall(report)
        return f"local rank {found[-1][1]} exited with code {found[-1][0]}" if found else None

    def root_cause(self, report: str) -> int | None:
        _, found, tail = report.rpartition("Root Cause (first observed failure)")
        match = re.search(r"rank\s*:\s*(\d+)", tail) if found else None
        return int(match.group(1)) if match else None

    def rendezvous_failure(self, report: str, expired: bool = False) -> str | None:
        return rendezvous_failure(report, self.nodes, self.rdzv_timeout, expired)


def rendezvous_failure(report: str, nodes: Nodes | None, rdzv_timeout: float, expired: bool = False) -> str | None:
    """torch's store errors at the start of a multi-node run, told as what the user must check."""
    if nodes is None:
        return None
    within = f"within --rdzv-timeout {rdzv_timeout:g}s"
    missing = _NODES_MISSING.search(report)
    if missing or (expired and nodes.rank == 0):
        # torch's count when it said it first; else node 0's own deadline passed with node 0 there, which with
        # two nodes is the same count: one message, whichever reports first.
        expected = int(missing.group(2)) if missing else nodes.count
        joined = f"only {missing.group(1)} of" if missing else "only 1 of" if expected == 2 else "not all"
        return (f"{joined} {expected} nodes joined the rendezvous at {nodes.endpoint} {within}; nothing was "
                f"trained. Start the same `nbddp run` on every node, with --node-rank "
                f"{'1' if expected == 2 else f'1 to {expected - 1}'} on the others, and check "
                f"that they can reach {nodes.endpoint} (a firewall, a wrong host name?).")
    if _NO_HOST.search(report) or expired:
        return (f"node 0's rendezvous at {nodes.endpoint} never answered {within}; nothing was trained. Is the same "
                f"`nbddp run` with --node-rank 0 running there, and can this node reach {nodes.endpoint}?")
    if _PORT_TAKEN.search(report) and nodes.rank == 0:
        return (f"the rendezvous port {nodes.host_port()[1]} is already in use on node 0: choose another free port "
                f"in --rdzv-endpoint (on every node).")
    return None
