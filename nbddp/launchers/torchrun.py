"""``torch.distributed.run`` (torchrun): the torch engine's launcher, on one machine or one node of several."""

from __future__ import annotations

import math
import re
from pathlib import Path

from nbddp.devices import Devices
from nbddp.launchers import Launcher
from nbddp.options import DEFAULT_RDZV_TIMEOUT, Nodes
from nbddp.job.rundir import RunDir

_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_NODES_MISSING = re.compile(r"waiting for clients\. (\d+)/(\d+) clients joined")
_NO_HOST = re.compile(r"timed out after \d+ms while trying to connect to \(([^,]+), (\d+)\)")
_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


class Torchrun(Launcher):
    name = "torchrun"
    supports_restarts = True

    def __init__(self, nodes: Nodes | None = None, rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT) -> None:
        self.nodes, self.rdzv_timeout = nodes, rdzv_timeout

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        """On one machine a fresh c10d store on an OS-chosen free port (``--standalone``: two runs at
        once never collide); across nodes torchrun's *static* rendezvous at node 0.

        Static, not c10d's dynamic rendezvous: node 0 runs the kernel and must hold global rank 0
        (the weights are saved there). The dynamic rendezvous ranks nodes by sorting their
        descriptors, so node 0 could get any rank; the static one honours ``--node-rank``.

        torchrun runs in its own process, never ``elastic_launch`` inside the kernel (it replaces the
        kernel's SIGINT handler). ``--log-dir`` keeps torchrun's folder in the run dir: without it,
        every run leaves a ``torchelastic_*`` folder in the system temp folder.
        """
        return [python, "-m", "torch.distributed.run", *self.topology_args(), f"--nproc-per-node={devices.nproc}",
                f"--max-restarts={max_restarts}", "--monitor-interval=0.1", f"--log-dir={run_dir.torchrun_logs}",
                str(script)]

    def topology_args(self) -> list[str]:
        """``--standalone``, or this node's part of a static rendezvous."""
        if self.nodes is None:
            return ["--standalone"]
        return [f"--nnodes={self.nodes.count}", f"--node-rank={self.nodes.rank}", "--rdzv-backend=static",
                f"--rdzv-endpoint={self.nodes.endpoint}", f"--rdzv-conf=timeout={math.ceil(self.rdzv_timeout)}"]

    def rank_exit_codes(self, report: str) -> dict[int, int]:
        return {int(rank): int(code) for rank, code in _FAILURE.findall(report)}

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
    if missing:
        joined, expected = int(missing.group(1)), int(missing.group(2))
        return (f"only {joined} of {expected} nodes joined the rendezvous at {nodes.endpoint} {within}; nothing was "
                f"trained. Start the same `nbddp run` on every node, with --node-rank "
                f"{'1' if expected == 2 else f'1 to {expected - 1}'} on the others, and check "
                f"that they can reach {nodes.endpoint} (a firewall, a wrong host name?).")
    if _NO_HOST.search(report) or (expired and nodes.rank != 0):
        return (f"node 0's rendezvous at {nodes.endpoint} never answered {within}; nothing was trained. Is the same "
                f"`nbddp run` with --node-rank 0 running there, and can this node reach {nodes.endpoint}?")
    if _PORT_TAKEN.search(report) and nodes.rank == 0:
        return (f"the rendezvous port {nodes.host_port()[1]} is already in use on node 0: choose another free port "
                f"in --rdzv-endpoint (on every node).")
    if expired:
        return (f"the {nodes.count} nodes never all met at {nodes.endpoint} {within}; nothing was trained. Start the "
                f"same `nbddp run` on every node and check that they can reach {nodes.endpoint}.")
    return None
