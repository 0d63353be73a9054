"""``torch.distributed.run`` (torchrun): the torch engine's launcher, on one machine or one node of several.

:func:`torchrun_options` is the one place torchrun's command line is written. The launcher's argv,
the line a Slurm job's tasks run (:mod:`nbddp.launchers.slurm`) and the command an exported
script's header tells a person to type (:mod:`nbddp.doors.export`) are renderings of it, so the
three can't disagree about nodes, rendezvous or timeouts (a test parses all three with torchrun's
own argument parser).
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Sequence

from nbddp.devices import CPU_PROCESSES, Devices
from nbddp.launchers import Launcher
from nbddp.options import DEFAULT_RDZV_TIMEOUT, Nodes
from nbddp.job.rundir import RunDir

#: What runs torchrun: ``python -m torch.distributed.run`` (not the ``torchrun`` script, which may
#: belong to another interpreter than the one that has nbddp).
MODULE = ("-m", "torch.distributed.run")
#: What nbddp's launcher runs: torchrun's own ``main``, minus the collection at its exit
#: (:mod:`nbddp.launchers.torchrun_main`); the same options, the same behaviour.
LAUNCHER_MODULE = ("-m", "nbddp.launchers.torchrun_main")
_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_NODES_MISSING = re.compile(r"waiting for clients\. (\d+)/(\d+) clients joined")
_NO_HOST = re.compile(r"timed out after \d+ms while trying to connect to \(([^,]+), (\d+)\)")
_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


def torchrun_options(nproc: int | str, *, nnodes: int | str = 1, node_rank: int | str | None = None,
                     endpoint: str | None = None, rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT,
                     max_restarts: int | None = None, monitor: bool = False, log_dir: str | None = None) -> list[str]:
    """torchrun's options for one node: everything between ``python -m torch.distributed.run`` and the script.

    One machine (``nnodes == 1``): ``--standalone``, a fresh c10d store on an OS-chosen free port, so two
    runs at once never collide. Several nodes: torchrun's *static* rendezvous at ``endpoint`` (node 0),
    with ``node_rank`` (a number, or a placeholder such as ``"$SLURM_NODEID"`` or ``R``). Static, not c10d's
    dynamic rendezvous: node 0 runs the kernel and must hold global rank 0 (the weights are saved there);
    the dynamic one ranks nodes by sorting their descriptors, the static one honours ``--node-rank``.

    ``monitor``: check the ranks every 0.1 s (torchrun's default is 5 s: a failure would be seen late);
    ``log_dir``: keep torchrun's folder there (without it, every run leaves a ``torchelastic_*`` folder
    in the system temp folder); ``max_restarts``: ``None`` leaves torchrun's default.
    """
    if nnodes == 1:
        options = ["--standalone"]
    else:
        options = [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=static",
                   f"--rdzv-endpoint={endpoint}", f"--rdzv-conf=timeout={math.ceil(rdzv_timeout)}"]
    options.append(f"--nproc-per-node={nproc}")
    if max_restarts is not None:
        options.append(f"--max-restarts={max_restarts}")
    if monitor:
        options.append("--monitor-interval=0.1")
    if log_dir is not None:
        options.append(f"--log-dir={log_dir}")
    return options


def by_hand(options: Sequence[str], script: str, python: str = "python") -> str:
    """What a person types to run ``script`` under torchrun with ``options`` (placeholders left as they are)."""
    return " ".join([python, *MODULE, *(_shell_word(o) for o in options), shlex.quote(script)])


def default_hint(script: str) -> str:
    """The header's command when the export named no devices: ``CPU_PROCESSES`` processes, which on a
    GPU machine are one per GPU, so the header says how to start one per GPU there (a rank beyond the GPUs
    is refused: :func:`nbddp.devices.rank_gpu`)."""
    return (by_hand(torchrun_options(CPU_PROCESSES), script)
            + f"   (with G GPUs: {torchrun_options('G')[-1]}, one process per GPU)")


def _shell_word(option: str) -> str:
    """``--x=VALUE`` quoted for a shell unless it only holds characters a shell leaves alone."""
    return option if re.fullmatch(r"[\w./:=,@%+$-]+", option) else shlex.quote(option)


class Torchrun(Launcher):
    name = "torchrun"
    supports_restarts = True

    def __init__(self, nodes: Nodes | None = None, rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT) -> None:
        self.nodes, self.rdzv_timeout = nodes, rdzv_timeout

    @classmethod
    def for_job(cls, spec) -> "Torchrun":  # noqa: ANN001 - nbddp.job.lifecycle.JobSpec
        return cls(spec.launch.nodes, spec.launch.rdzv_timeout)

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        """torchrun in its own process, never ``elastic_launch`` inside the kernel (it replaces the
        kernel's SIGINT handler)."""
        return [python, *LAUNCHER_MODULE, *self.options(devices.nproc, max_restarts, str(run_dir.torchrun_logs)),
                str(script)]

    def options(self, nproc: int, max_restarts: int = 0, log_dir: str | None = None) -> list[str]:
        """This launcher's torchrun options (this node's part, when there are several)."""
        if self.nodes is None:
            return torchrun_options(nproc, max_restarts=max_restarts, monitor=True, log_dir=log_dir)
        return torchrun_options(nproc, nnodes=self.nodes.count, node_rank=self.nodes.rank,
                                endpoint=self.nodes.endpoint, rdzv_timeout=self.rdzv_timeout,
                                max_restarts=max_restarts, monitor=True, log_dir=log_dir)

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
