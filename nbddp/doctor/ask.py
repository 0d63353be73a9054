"""What the doctor examines: the run a user asks for, as data a check's subprocess reads (JSON on its stdin).

``nbddp doctor`` takes ``nbddp run``'s device, node and cluster options, so ``nbddp doctor --gpus 4`` examines what
``nbddp run nb.ipynb --gpus 4`` would meet: the devices are decided by the launchers' own rule
(:func:`nbddp.launchers.devices_for`), and a refusal of them (more GPUs than visible) is the ``gpus`` check's
finding rather than an error that stops the other checks.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbddp.contracts.devices import CPU_PROCESSES, Devices
from nbddp.contracts.errors import DeviceError
from nbddp.doctor.allreduce import FAULT_VARIABLE

if TYPE_CHECKING:
    from nbddp.plan.options import LaunchOptions

#: Every check, in the order they are said (each one's body: :data:`nbddp.doctor.checks.BODIES`).
CHECKS = ("versions", "gpus", "allreduce", "shm", "memlock", "files", "folder", "loopback", "endpoint")
#: DataLoader worker processes per rank that ``/dev/shm``'s and the open files' needs are counted for (``--workers``).
DEFAULT_WORKERS = 2
#: Seconds a check may take (``NBDDP_DOCTOR_TIMEOUT`` replaces it): a torch import on a loaded machine and a
#: 2-rank all-reduce fit many times over; a hang is cut there.
DEFAULT_LIMIT = 20.0
LIMIT_VARIABLE = "NBDDP_DOCTOR_TIMEOUT"


@dataclass(frozen=True)
class Ask:
    """One run as asked, for the checks: the devices of this machine's part of it, its folder, its endpoint."""

    kind: str = "cpu"
    """``cuda`` (one rank per GPU, NCCL) or ``cpu`` (gloo)."""
    nproc: int = CPU_PROCESSES
    gpu_ids: tuple[str, ...] = ()
    """The GPUs chosen by name (``--gpus free``): the ranks see only them."""
    gpus: str | None = None
    """``--gpus`` as given (``None``: every visible GPU, else the CPU)."""
    devices_refused: str = ""
    """Why the asked devices can't be had here (the launchers' refusal), when they can't."""
    devices_unknown: str = ""
    """Why the devices couldn't be decided at all (the driver didn't answer): the CPU's are examined instead."""
    workers: int = DEFAULT_WORKERS
    folder: str = "runs"
    """The folder runs go in: a run dir's parent (``--run-dir``'s), else ``runs/`` here (beside a notebook here)."""
    run_dir: str = ""
    """``--run-dir`` as given: a run refuses it as it is, when it is there already."""
    nodes: int = 1
    node_rank: int = 0
    endpoint: str = ""
    """Node 0's ``HOST:PORT`` (``--rdzv-endpoint``) in a run of several nodes; its parts, as the option reads them:"""
    host: str = ""
    port: int = 0
    slurm: bool = False
    ray: str | None = None
    """``--ray``'s address (``auto``: ``RAY_ADDRESS``, else the cluster started on this machine)."""
    own_pid: int | None = None
    """The process asking (a kernel's ``%ddp_doctor``): what it holds of a GPU is named as its own."""
    limit: float = field(default_factory=lambda: limit_seconds())
    fault: str = field(default_factory=lambda: os.environ.get(FAULT_VARIABLE, ""))
    """A fault the tests inject into the all-reduce's ranks (``hang``: the last rank never joins)."""

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" else "gloo"

    @property
    def on_a_cluster(self) -> str:
        """``Slurm``/``Ray`` when the ranks run on a cluster's machines, not this one's; else ``""``."""
        return "Slurm" if self.slurm else "Ray" if self.ray is not None else ""

    def describe(self) -> str:
        """What the run would start, as the doctor's first line says it."""
        if self.on_a_cluster:
            return f"a run on {self.on_a_cluster}'s nodes (this machine runs the notebook's kernel)"
        ranks = (f"{self.nproc} GPU{'s' * (self.nproc != 1)} (NCCL)" if self.kind == "cuda"
                 else f"{self.nproc} CPU process{'es' * (self.nproc != 1)} (gloo)")
        said = ranks + (f", node {self.node_rank} of {self.nodes}" if self.nodes > 1 else " on this machine")
        if self.devices_refused or self.devices_unknown:
            return f"the devices asked for can't be had (see gpus): examining {said} instead"
        return said

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Ask":
        given = json.loads(text)
        given["gpu_ids"] = tuple(given.get("gpu_ids", ()))
        return cls(**given)


def limit_seconds() -> float:
    """A check's time limit: ``NBDDP_DOCTOR_TIMEOUT`` where set (a positive number), else :data:`DEFAULT_LIMIT`."""
    try:
        given = float(os.environ.get(LIMIT_VARIABLE, ""))
    except ValueError:
        return DEFAULT_LIMIT
    return given if given > 0 else DEFAULT_LIMIT


def asked(launch: "LaunchOptions", run_dir: Path | None = None, workers: int = DEFAULT_WORKERS,
          own_pid: int | None = None, ours: tuple[str, ...] = ()) -> Ask:
    """The :class:`Ask` of ``launch`` on this machine: its devices by the launchers' rule (a refusal kept as the
    ``gpus`` check's finding, the ranks then counted as a run with no device option would have them). ``ours``: the
    GPUs the asking kernel's warm ranks hold (free to its runs, as to ``--gpus free``)."""
    from nbddp.launchers import devices_for

    common = dict(gpus=launch.gpus, workers=workers, own_pid=own_pid, **folders(run_dir), **where(launch))
    if launch.slurm is not None or launch.ray is not None:  # (their nodes' devices are the cluster's to say)
        return Ask(kind="cpu", nproc=launch.nproc or CPU_PROCESSES, **common)
    refused = ""
    try:  # (--wait would wait for GPUs the run will find: the doctor judges them as they are now)
        devices = devices_for(replace(launch, wait=False), ours=ours)
    except DeviceError as exc:
        refused, devices = str(exc), _fallback(launch)
    return Ask(kind=devices.kind, nproc=devices.nproc, gpu_ids=devices.gpu_ids, devices_refused=refused, **common)


def asked_within(launch: "LaunchOptions", run_dir: Path | None = None, workers: int = DEFAULT_WORKERS,
                 own_pid: int | None = None, ours: tuple[str, ...] = ()) -> Ask:
    """:func:`asked`, in a subprocess within the checks' limit: deciding the devices asks the driver (NVML), and a
    driver that stopped answering (a GPU fallen off the bus) must not hang the doctor before its first check. Then
    the devices are unknown (:attr:`Ask.devices_unknown`: the ``gpus`` check's finding) and the CPU's are examined."""
    import subprocess

    from nbddp.contracts.interpreter import module_argv

    given = {"run_dir": str(run_dir) if run_dir is not None else None, "workers": workers, "own_pid": own_pid,
             "ours": list(ours)}
    limit = limit_seconds()
    try:
        done = subprocess.run(module_argv("nbddp.doctor.ask", json.dumps(given), *launch.to_argv()),
                              capture_output=True, text=True, timeout=limit, stdin=subprocess.DEVNULL)
        return Ask.from_json(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        unknown = f"the driver (NVML) did not answer in {limit:g} s when asked for the GPUs"
    except (IndexError, ValueError, TypeError):
        unknown = f"the GPUs could not be counted: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"
    return Ask(kind="cpu", nproc=launch.nproc or CPU_PROCESSES, gpus=launch.gpus, devices_unknown=unknown,
               workers=workers, own_pid=own_pid, **folders(run_dir), **where(launch))


def folders(run_dir: Path | None) -> dict[str, str]:
    """:class:`Ask`'s ``folder`` and ``run_dir`` for ``--run-dir`` (``None``: ``runs/`` here), absolute."""
    if run_dir is None:
        return {"folder": str(Path("runs").absolute()), "run_dir": ""}
    given = run_dir.expanduser().absolute()
    return {"folder": str(given.parent), "run_dir": str(given)}


def where(launch: "LaunchOptions") -> dict[str, Any]:
    """:class:`Ask`'s fields that say where ``launch``'s ranks run: its nodes and endpoint, or its cluster."""
    found: dict[str, Any] = {"slurm": launch.slurm is not None,
                             "ray": launch.ray.address if launch.ray is not None else None}
    if launch.nodes is not None:
        host, port = launch.nodes.host_port()
        found |= {"nodes": launch.nodes.count, "node_rank": launch.nodes.rank, "endpoint": launch.nodes.endpoint,
                  "host": host, "port": port}
    return found


def _fallback(launch: "LaunchOptions") -> Devices:
    """The devices the other checks examine when the asked ones are refused: every visible GPU, else the CPU."""
    from nbddp.contracts.devices import resolve

    try:
        return resolve(None, launch.cpu)
    except DeviceError:
        return Devices("cpu", launch.nproc or CPU_PROCESSES)


def main(argv: list[str]) -> None:
    """``python -m nbddp.doctor.ask GIVEN-JSON LAUNCH-OPTIONS...``: :func:`asked`'s :class:`Ask`, as JSON."""
    from nbddp.plan.options import RUN, ArgumentParser, add_launch_arguments, launch_options

    given = json.loads(argv[0])
    parser = ArgumentParser(prog="nbddp doctor")
    add_launch_arguments(parser, RUN)
    launch = launch_options(parser.parse_args(argv[1:]))
    run_dir = Path(given["run_dir"]) if given["run_dir"] else None
    print(asked(launch, run_dir, given["workers"], given["own_pid"], tuple(given["ours"])).to_json(), flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
