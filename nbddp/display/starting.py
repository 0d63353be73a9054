"""What is starting, said once, as a run's ranks start: the engine, the devices and nodes, the run dir.

``nbddp run`` (every node of a multi-node run) and papermill's engine say it before the ranks' first lines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nbddp.plan.job_spec import JobSpec


def describe(spec: "JobSpec") -> str:
    """``torch engine, 2 CPU processes (gloo); run dir …``: what is starting, in one line."""
    if spec.launch.slurm is not None:
        nodes = spec.launch.slurm.nodes
        where = f"a Slurm job of {nodes} node{'s' * (nodes != 1)} × {spec.devices.describe()}"
    elif spec.launch.ray is not None:
        nodes = spec.launch.ray.nodes
        where = f"{nodes} node{'s' * (nodes != 1)} × {spec.devices.describe()} of {spec.launch.ray.where()}"
    elif spec.launch.nodes is not None:
        where = f"{spec.devices.describe()} on each of {spec.launch.nodes.count} nodes (world size {spec.world_size})"
    else:
        where = spec.devices.describe()
    return f"{spec.script.engine} engine, {where}; run dir {spec.run_dir}"
