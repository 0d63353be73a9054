"""How an exported script is launched by hand: the header's command, and the sbatch script for Slurm.

The launchers' own knowledge (torchrun's options, a Slurm job's script, the Ray driver's command), written for a
person instead of run: ``nbddp export`` asks for it through the launchers' face (:func:`nbddp.launchers.export_launch`).

``nbddp export`` takes the same device, node, Slurm and Ray flags as ``nbddp run``, checked as a
run's are (by :class:`~nbddp.plan.options.LaunchOptions`); instead of launching, it writes what a person
types (the per-node torchrun command, or the Ray driver's, in the script's header) or submits (``train.sbatch``
beside ``train.py``, made by the same generator ``nbddp run --slurm`` submits). Nothing here probes this machine's
devices: the script runs elsewhere.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, replace

from nbddp.notebook.cells import select_cells
from nbddp.contracts.devices import CPU_PROCESSES, Devices
from nbddp.engines import detect_engine, spawns_its_own_ranks
from nbddp.contracts.errors import UsageError
from nbddp.notebook.reader import Notebook
from nbddp.engines.torch import by_hand, torchrun_options
from nbddp.contracts.rank_env import RankEnv
from nbddp.plan.options import DEFAULT_MAX_REQUEUES, DEFAULT_RDZV_TIMEOUT, LaunchOptions, Nodes


@dataclass(frozen=True)
class ExportPlan:
    engine: str
    hint: str | None
    """The header's launch command (``None``: the engine's one-machine default)."""
    sbatch: str | None = None
    """The batch script's text, for ``--slurm``."""


def export_launch(launch: LaunchOptions, notebook: Notebook, script_name: str) -> ExportPlan:
    """The launch plan of an export, from ``nbddp export``'s launch options (checked as a run's are)."""
    engine = launch.engine or detect_engine(select_cells(notebook, train_cell=launch.train_cell))
    if launch.ray is not None:
        return ExportPlan(engine, ray_hint(replace(launch, engine=engine), script_name))
    devices = _devices(launch)
    slurm, nodes = launch.slurm, launch.nodes
    if slurm is not None:
        from nbddp.launchers.slurm import sbatch_script

        if slurm.requeue or slurm.max_requeues != DEFAULT_MAX_REQUEUES:
            raise UsageError("--requeue, --max-requeues: only for jobs nbddp submits and watches (nbddp run, batch, "
                             "%%ddp_train --slurm); a batch script exported to submit by hand runs --no-requeue.")
        # The interpreter that exported it (a venv the nodes share); PYTHON= in the file says which.
        sbatch = sbatch_script(engine, slurm, devices or Devices("cpu", CPU_PROCESSES), script_name,
                               python=sys.executable, rdzv_timeout=launch.rdzv_timeout,
                               job_name=f"nbddp-{notebook.path.stem}")
        sbatch_name = shlex.quote(script_name.rsplit('.', 1)[0] + ".sbatch")
        return ExportPlan(engine, f"sbatch {sbatch_name}  (Slurm; see that file)", sbatch)
    if nodes is None:
        return ExportPlan(engine, None if devices is None else local_hint(engine, devices, script_name))
    return ExportPlan(engine, node_hint(engine, nodes, devices or Devices("cpu", CPU_PROCESSES), script_name,
                                       launch.rdzv_timeout))


def _devices(launch: LaunchOptions) -> Devices | None:
    """The devices the header and batch script name; ``None``: the engine's one-machine default."""
    from nbddp.contracts.devices import requested_gpus

    if launch.slurm is not None:  # the script runs on the cluster: no Slurm commands needed here to write it
        from nbddp.launchers.slurm import slurm_devices

        return slurm_devices(launch.slurm, launch.cpu, launch.nproc, require_commands=False)
    if launch.gpus is not None:
        return Devices("cuda", requested_gpus(launch.gpus))
    if launch.cpu or launch.nproc is not None:
        return Devices("cpu", launch.nproc or CPU_PROCESSES)
    return None


def ray_hint(launch: LaunchOptions, script: str) -> str:
    """The Ray driver's command (what ``nbddp run --ray`` starts), with a folder for the ranks' logs."""
    from nbddp.launchers.ray import driver_command, ray_devices

    devices = ray_devices(launch.ray, launch.cpu, launch.nproc, require=False)  # (the driver runs elsewhere)
    argv = driver_command(launch.ray, devices, "ray-run", script, python="python", start_timeout=launch.rdzv_timeout)
    return (" ".join(shlex.quote(a) for a in argv) + "   (Ray; every rank's output: ray-run/logs/rank-N.log; the "
            "nodes must share this folder)")


def local_hint(engine: str, devices: Devices, script: str) -> str:
    """The command that runs the script on one machine."""
    if spawns_its_own_ranks(engine):
        return f"{RankEnv.shell(nproc=devices.nproc, device=devices.kind)} python {shlex.quote(script)}"
    return by_hand(torchrun_options(devices.nproc), script)


def node_hint(engine: str, nodes: Nodes, devices: Devices, script: str,
              rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT) -> str:
    """The command every node runs, ``R`` standing for its node rank."""
    host = nodes.host_port()[0]
    others = "1" if nodes.count == 2 else f"1 to {nodes.count - 1}"
    where = f"   (on every node: R=0 on {host}, R={others} on the others)"
    if spawns_its_own_ranks(engine):
        variables = RankEnv.shell(nnodes=nodes.count, node_rank="R", master=shlex.quote(nodes.endpoint),
                                  nproc=devices.nproc, device=devices.kind)
        return f"{variables} python {shlex.quote(script)}" + where
    options = torchrun_options(devices.nproc, nnodes=nodes.count, node_rank="R", endpoint=nodes.endpoint,
                               rdzv_timeout=rdzv_timeout)
    return by_hand(options, script) + where
