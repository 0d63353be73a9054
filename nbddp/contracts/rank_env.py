"""The environment nbddp gives every rank: every ``NBDDP_*`` variable a rank reads, named here only.

The launcher side builds a :class:`RankEnv` and turns it into the ``env`` of the launcher's ``Popen``
(this process's own ``os.environ`` is never changed), or into ``NAME=value`` shell words for a
batch script or a script's header (:meth:`RankEnv.shell`); the rank side reads it back with
:meth:`RankEnv.from_environ`. Without a launcher (``python train.py``, a kernel) every field is empty
and the runtime degrades to a plain single process. Nothing here imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from nbddp.contracts.rundir import RunDir

#: ``--rdzv-timeout``'s default: how long the nodes of a multi-node run wait for each other before failing
#: (a rank started without ``NBDDP_RDZV_TIMEOUT``, Catalyst's by hand across nodes, waits as long).
DEFAULT_RDZV_TIMEOUT = 300.0
#: ``%ddp_ranks --idle``'s default: warm ranks with no job for this long (seconds) leave the group and exit
#: (a warm rank started without ``NBDDP_WARM_IDLE`` waits as long).
DEFAULT_WARM_IDLE = 600.0

#: Field → variable. The only place these names are spelled.
VARIABLES = {
    "run_dir": "NBDDP_RUN_DIR",
    "device": "NBDDP_DEVICE",
    "nproc": "NBDDP_NPROC",
    "checkpoint": "NBDDP_CHECKPOINT",
    "collective_timeout": "NBDDP_COLLECTIVE_TIMEOUT",
    "nnodes": "NBDDP_NNODES",
    "node_rank": "NBDDP_NODE_RANK",
    "master": "NBDDP_MASTER",
    "rdzv_timeout": "NBDDP_RDZV_TIMEOUT",
    "warm": "NBDDP_WARM",
    "warm_idle": "NBDDP_WARM_IDLE",
    "requeue": "NBDDP_REQUEUE",
    "requeues": "NBDDP_REQUEUES",
    "store": "NBDDP_STORE",
    "parent": "NBDDP_PARENT",
    "log_cap": "NBDDP_LOG_CAP",
    "track_every_rank": "NBDDP_TRACK_EVERY_RANK",
    "tensorboard_dir": "NBDDP_TENSORBOARD_DIR",
    "debugger": "NBDDP_DEBUGGER",
    "debug_on_failure": "NBDDP_DEBUG_ON_FAILURE",
    "kernel_beside_job": "NBDDP_KERNEL_BESIDE_JOB",
    "prepare_ahead": "NBDDP_PREPARE_AHEAD",
}

#: Environment variables (prefixes) that differ between runs by design, that nbddp sets per run, or that a library
#: sets in the kernel when imported there: none of them makes warm ranks stale (:func:`nbddp.launchers.warm.rules.
#: pool_key`), nor a preloaded starter (:mod:`nbddp.launchers.warm.agent`).
PER_RUN_VARIABLES = ("NBDDP_", "JPY_", "PYDEVD_", "TERM", "COLUMNS", "LINES",
                     # Set by a library on import (Lightning): a rank that imports it sets them too.
                     "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR",
                     # Set by a tracker in the kernel (MLflow's telemetry session on import, W&B's service on
                     # wandb.init); a rank never uses the kernel's service (nbddp.rank_side.trackers).
                     "_MLFLOW_", "WANDB_SERVICE")


def kernel_beside_a_job(environ: Mapping[str, str] | None = None) -> bool:
    """``NBDDP_KERNEL_BESIDE_JOB`` (no rank reads it): this kernel runs a notebook's other cells beside its job
    (``nbddp run``, papermill's nbddp engine), whose ranks are the job's own: its ``%load_ext nbddp`` prepares no
    warm ranks."""
    return (os.environ if environ is None else environ).get(VARIABLES["kernel_beside_job"]) == "1"


def prepares_ranks_ahead(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``%load_ext nbddp`` starts the warm ranks' starter ahead of the first run: not in a kernel beside a job,
    nor with ``NBDDP_PREPARE_AHEAD=0`` (a machine too tight to hold torch's imports on speculation; the test suite,
    whose kernels mostly never train on warm ranks, but for the tests of warm ranks)."""
    environ = os.environ if environ is None else environ
    return not kernel_beside_a_job(environ) and environ.get(VARIABLES["prepare_ahead"]) != "0"


def beside_a_job(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for such a kernel."""
    return {**environ, VARIABLES["kernel_beside_job"]: "1"}


def threads_per_rank(nproc: int) -> str:
    """``OMP_NUM_THREADS`` for one of a machine's ``nproc`` ranks: its share of the CPUs (at least 1)."""
    return str(max(1, (os.cpu_count() or 1) // nproc))


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    run_dir: RunDir | None = None
    """``NBDDP_RUN_DIR``: where the rank writes its log, error report and marks."""
    device: str = ""
    """``NBDDP_DEVICE``: ``cuda`` or ``cpu`` (``cpu`` keeps a rank off the GPUs even where there are some)."""
    nproc: int | None = None
    """``NBDDP_NPROC``: the world size on this machine (Catalyst's spawn reads it)."""
    checkpoint: Path | None = None
    """``NBDDP_CHECKPOINT``: where rank 0 saves the returned variables."""
    collective_timeout: float | None = None
    """``NBDDP_COLLECTIVE_TIMEOUT``: seconds a rank waits in a collective before raising."""
    nnodes: int | None = None
    """``NBDDP_NNODES``: nodes of a multi-node run (Catalyst's engine reads it; torchrun has its own)."""
    node_rank: int | None = None
    """``NBDDP_NODE_RANK``: this node's rank in a multi-node run."""
    master: str = ""
    """``NBDDP_MASTER``: ``HOST:PORT`` of node 0's rendezvous (Catalyst's rank 0 listens there)."""
    rdzv_timeout: float | None = None
    """``NBDDP_RDZV_TIMEOUT``: how long a multi-node rank waits for the others to join."""
    warm: bool = False
    """``NBDDP_WARM``: the rank is a warm rank, running job after job in one process group."""
    warm_idle: float | None = None
    """``NBDDP_WARM_IDLE``: seconds a warm rank waits for its next job before exiting."""
    requeue: bool = False
    """``NBDDP_REQUEUE``: a Slurm job that requeues itself: when Slurm signals it (time limit near,
    preemption), every rank stops at its next ``nbddp.save_checkpoint``."""
    requeues: int | None = None
    """``NBDDP_REQUEUES``: how many times Slurm requeued this job before (``SLURM_RESTART_COUNT``)."""
    log_cap: int | None = None
    """``NBDDP_LOG_CAP``: the most bytes a rank's log keeps (``--log-cap``; its start and its last lines:
    :mod:`nbddp.rank_side.log_cap`); ``None``: no cap."""
    parent: int | None = None
    """``NBDDP_PARENT``: the pid of the process that started this one (a launcher for its ranks), which a rank
    must still have as its parent once its death signal is armed
    (:func:`~nbddp.rank_side.parent_death.die_with_parent`)."""
    store: Path | None = None
    """``NBDDP_STORE``: a run on one machine: the private folder where its ranks meet (a FileStore per
    attempt, :mod:`nbddp.launchers.private_rendezvous`), instead of a TCPStore at ``MASTER_ADDR``."""
    track_every_rank: bool = False
    """``NBDDP_TRACK_EVERY_RANK``: every rank keeps its MLflow, TensorBoard and W&B records, named by rank
    (by default only rank 0's are: :mod:`nbddp.rank_side.trackers`)."""
    tensorboard_dir: Path | None = None
    """``NBDDP_TENSORBOARD_DIR``: the folder of the kernel's open TensorBoard writer: rank 0's writer that names
    no folder of its own writes there."""

    debugger: bool = False
    """``NBDDP_DEBUGGER``: someone can type into a rank's debugger (a kernel whose front end answers input, a
    terminal): a ``breakpoint()`` opens a relayed session; without it (papermill, a batch, a detached run) it is
    skipped with one line (:mod:`nbddp.rank_side.debugger`)."""
    debug_on_failure: bool = False
    """``NBDDP_DEBUG_ON_FAILURE``: a rank's uncaught exception opens a post-mortem session before the rank ends
    (``nbddp run --debug-on-failure``)."""

    def variables(self) -> dict[str, str]:
        """The variables this environment sets (empty fields left out)."""
        found = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None or value == "" or value is False:
                continue
            found[VARIABLES[field.name]] = "1" if value is True else str(value)
        return found

    def to_environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` without any ``NBDDP_*`` variable of its own, plus this environment's, for ``Popen(env=...)``."""
        env = {k: v for k, v in base.items() if k not in VARIABLES.values()}
        env |= self.variables()
        env["PYTHONUNBUFFERED"] = "1"
        if "OMP_NUM_THREADS" not in env and self.nproc:  # torchrun would set 1 and warn about it
            env["OMP_NUM_THREADS"] = threads_per_rank(self.nproc)
        return env

    @staticmethod
    def shell(**values: Any) -> str:
        """``NBDDP_X=value …`` words for a shell (values given as they must appear, placeholders included)."""
        return " ".join(f"{VARIABLES[name]}={value}" for name, value in values.items())

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "RankEnv":
        environ = os.environ if environ is None else environ
        get = {name: environ.get(variable, "") for name, variable in VARIABLES.items()}
        return cls(
            run_dir=RunDir(Path(get["run_dir"])) if get["run_dir"] else None,
            device=get["device"],
            nproc=int(get["nproc"]) if get["nproc"] else None,
            checkpoint=Path(get["checkpoint"]) if get["checkpoint"] else None,
            collective_timeout=float(get["collective_timeout"]) if get["collective_timeout"]
            and float(get["collective_timeout"]) > 0 else None,
            nnodes=int(get["nnodes"]) if get["nnodes"] else None,
            node_rank=int(get["node_rank"]) if get["node_rank"] else None,
            master=get["master"],
            rdzv_timeout=float(get["rdzv_timeout"]) if get["rdzv_timeout"] else None,
            warm=get["warm"] == "1",
            warm_idle=float(get["warm_idle"]) if get["warm_idle"] else None,
            requeue=get["requeue"] == "1",
            requeues=int(get["requeues"]) if get["requeues"].isdigit() else None,
            store=Path(get["store"]) if get["store"] else None,
            parent=int(get["parent"]) if get["parent"].isdigit() else None,
            log_cap=int(get["log_cap"]) if get["log_cap"].isdigit() and int(get["log_cap"]) > 0 else None,
            track_every_rank=get["track_every_rank"] == "1",
            tensorboard_dir=Path(get["tensorboard_dir"]) if get["tensorboard_dir"] else None,
            debugger=get["debugger"] == "1",
            debug_on_failure=get["debug_on_failure"] == "1",
        )
