"""Ray: the ranks run on a Ray cluster's workers while the notebook's kernel runs here.

Ray Core, not Ray Train's ``TorchTrainer`` nor Ray Jobs (docs/architecture.md says why): one
placement group with one bundle per node, one small actor per rank, and each actor runs the
generated script as a subprocess with torchrun's variables. The rank side is then exactly the one
torchrun starts: it joins its own process group, writes ``logs/rank-N.log`` and its error reports
into the run dir, and rank 0 writes the weights there. So, as with Slurm, the run dir must be on
storage every node reaches (one machine's cluster: any folder).

The job's local "launcher" process is :mod:`nbddp.launchers.ray_main`, the Ray driver: it prints the
cluster's state (``ray: ...`` lines, streamed like the Slurm watcher's), records the Ray job in
``RUN_DIR/ray/job.json`` and, on SIGTERM (Ctrl-C, ``--timeout``, the stop button, ``nbddp kill``),
stops every rank through its actor and waits until they are gone. This class is its side of the
seam: its command line and how to read its report. Nothing here imports ``ray``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from nbddp.contracts.atomic import read_json
from nbddp.contracts.devices import CPU_PROCESSES, Devices, asked_per_node
from nbddp.engines import spawns_its_own_ranks
from nbddp.contracts.errors import UsageError
from nbddp.launchers.base import Launcher
from nbddp.contracts.rundir import RunDir
from nbddp.plan.options import RayRequest, ray_refusal
from nbddp.contracts.interpreter import module_argv

if TYPE_CHECKING:
    from nbddp.plan.job_spec import JobSpec

_EXIT = re.compile(r"^ray: rank (\d+) exitcode (-?\d+)$", re.MULTILINE)
#: Seconds a rank has to end after SIGTERM before its actor SIGKILLs it.
RANK_GRACE = 10.0
#: How long nbddp gives the driver to stop every rank through its actor and see the actors gone.
STOP_SECONDS = RANK_GRACE + 40.0
#: The kernel's variables (by prefix) a rank gets on the cluster; the rest of its environment is its Ray
#: worker's own (another machine's PATH, HOME... would be wrong there). The one list; README names it.
FORWARDED = ("NBDDP_", "NCCL_", "TORCH_", "PYTORCH_", "CUDA_LAUNCH_BLOCKING", "HF_", "TRANSFORMERS_", "WANDB_",
             "PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: The launcher's exit code when the cluster, not the training, ended the run (never placed, unreachable).
CLUSTER_FAILED = 3


class Ray(Launcher):
    name = "ray"
    streams_launcher_log = True  # "ray: waiting for 2 × {CPU: 1} (NO_RESOURCES)", "ray: running on 10.0.0.2"
    stop_grace = STOP_SECONDS
    exit_settle = 3.0  # a lost worker is reported by the driver, which polls its actors 5 times a second
    job_record = "ray_job"

    def __init__(self, engine: str, request: RayRequest, start_timeout: float) -> None:
        """The Ray launcher for a run of ``engine`` asking for ``request``.

        Raises:
            UsageError: an engine that spawns its own ranks (Catalyst's): each rank is a Ray actor's process.
        """
        if spawns_its_own_ranks(engine):
            raise UsageError(ray_refusal(engine))
        self.request, self.start_timeout = request, start_timeout

    @classmethod
    def for_job(cls, spec: JobSpec) -> "Ray":
        return cls(spec.script.engine, spec.launch.ray, spec.launch.rdzv_timeout)

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        return driver_command(self.request, devices, str(run_dir.path), str(script), python=python,
                              start_timeout=self.start_timeout)

    def rank_exit_codes(self, report: str) -> dict[int, int]:
        return {int(rank): int(code) for rank, code in _EXIT.findall(report)}

    def ended_by_scheduler(self, run_dir: RunDir) -> str | None:
        """What the cluster did (never placed the ranks, lost a worker, wasn't there), from ``ray/job.json``."""
        return (self.job_info(run_dir) or {}).get("ended_by") or None

    def job_info(self, run_dir: RunDir) -> dict | None:
        return read_json(run_dir.ray_job)


def driver_command(request: RayRequest, devices: Devices, run_dir: str, script: str, *, python: str,
                   start_timeout: float) -> list[str]:
    """The Ray driver's argv (:mod:`nbddp.launchers.ray_main`): the one place it is written. With this interpreter,
    nbddp's own command (:func:`~nbddp.contracts.interpreter.module_argv`); with another, what a person types."""
    args = ["--address", request.address, "--nodes", str(request.nodes), "--nproc", str(devices.nproc),
            *(["--gpus"] if devices.kind == "cuda" else []), "--start-timeout", f"{start_timeout:g}", run_dir, script]
    if python == sys.executable:
        return module_argv("nbddp.launchers.ray_main", *args)
    return [python, "-m", "nbddp.launchers.ray_main", *args]


def ray_devices(request: RayRequest, cpu: bool, nproc: int | None, *, require: bool = True) -> Devices:
    """Per-node devices of a Ray run: ``--gpus-per-node G``, else ``--nproc`` CPU processes (default 2).

    Raises:
        UsageError: Ray isn't installed here (the driver runs on this machine), unless ``require`` is false
            (``nbddp export`` only writes the driver's command).
    """
    if require:
        require_ray()
    return asked_per_node(request.gpus_per_node, cpu, nproc) or Devices(
        "cpu", CPU_PROCESSES, note=f"--ray: {CPU_PROCESSES} CPU processes (gloo) per node; --gpus-per-node G trains "
                                   "on the workers' GPUs (--cpu --nproc P to choose CPU processes).")


def require_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        raise UsageError("--ray needs Ray here, in the kernel's Python (its version must equal the cluster's): "
                         "pip install 'nbddp[ray]'.")
