"""The launcher seam: which launcher starts a job's processes, on which devices.

A :class:`~nbddp.launchers.base.Launcher` starts every rank of a job (``start``, returning a
:class:`~nbddp.launchers.base.Launch` the job polls and stops) and hands back what it observed of them as
data (``observe``: a :class:`~nbddp.launchers.base.LaunchReport`, per-rank exit codes and the rest).
Everything else is shared: :class:`nbddp.job.lifecycle.Job` follows and judges whatever was started.

The launchers, chosen in one place (:func:`launcher_for`) by name:

* ``direct`` (:class:`~nbddp.launchers.direct.Direct`): on one machine, with no restarts to make, nbddp's
  own starter gives the ranks torchrun's variables and watches them, without torchrun's agent (2 s sooner);
* ``torchrun`` (:class:`~nbddp.launchers.torchrun.Torchrun`): ``torch.distributed.run``, on one machine
  with ``--max-restarts`` (its agent restarts the ranks) or as one node of several (static rendezvous at node 0);
* ``catalyst-spawn`` (:class:`~nbddp.launchers.catalyst_spawn.CatalystSpawn`): the script itself,
  whose Catalyst engine spawns the ranks with ``mp.spawn``;
* ``slurm`` (:class:`~nbddp.launchers.slurm.Slurm`): a Slurm job, one task per node running either
  of the above;
* ``ray`` (:class:`~nbddp.launchers.ray.Ray`): the ranks on a Ray cluster's workers, one Ray actor
  per rank running the script as torchrun would;
* ``warm`` (:class:`~nbddp.launchers.warm.launcher.WarmRanks`): ranks already running (a warm pool), handed
  the job's script.

Another package may register a launcher class under one of these names (or a new one) through
the ``nbddp.launchers`` entry point group; it replaces the built-in one of that name. The tests
use this to watch every front door's runs go through the seam.

This module is the launchers' one face to the doors: what a door needs of warm ranks (a kernel's
:class:`~nbddp.launchers.warm.keepers.KernelPool`, a batch's :class:`~nbddp.launchers.warm.keepers.BatchSlots`
and each of its runs' :func:`~nbddp.launchers.warm.keepers.batch_slot`,
:func:`~nbddp.launchers.warm.rules.why_not_warm`)
and of an exported script's launch by hand (:func:`~nbddp.launchers.by_hand.export_launch`) is named here, loaded
when first asked for (:data:`FACE`), so that importing this module starts nothing.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Callable

from nbddp.contracts.devices import Devices, notebook_devices, requested_gpus, resolve, wait_for_free
from nbddp.engines import spawns_its_own_ranks
from nbddp.launchers.base import Launcher
from nbddp.contracts import plugins
from nbddp.contracts.errors import UsageError
from nbddp.contracts.plugins import registered
from nbddp.contracts.process_groups import RECORD_SECONDS

if TYPE_CHECKING:
    from nbddp.plan.job_spec import JobSpec
    from nbddp.plan.options import LaunchOptions

ENTRY_POINTS = "nbddp.launchers"
#: What the doors may ask of the launchers beyond this module's own functions: name → the module that holds it.
FACE = {
    "KernelPool": "nbddp.launchers.warm.keepers",
    "BatchSlots": "nbddp.launchers.warm.keepers",
    "batch_slot": "nbddp.launchers.warm.keepers",
    "why_not_warm": "nbddp.launchers.warm.rules",
    "export_launch": "nbddp.launchers.by_hand",
    "ExportPlan": "nbddp.launchers.by_hand",
}


def __getattr__(name: str) -> object:
    if name in FACE:
        return getattr(import_module(FACE[name]), name)
    raise AttributeError(f"module 'nbddp.launchers' has no attribute {name!r}")

BUILTIN = {
    "direct": "nbddp.launchers.direct:Direct",
    "torchrun": "nbddp.launchers.torchrun:Torchrun",
    "catalyst-spawn": "nbddp.launchers.catalyst_spawn:CatalystSpawn",
    "slurm": "nbddp.launchers.slurm:Slurm",
    "warm": "nbddp.launchers.warm.launcher:WarmRanks",
    "ray": "nbddp.launchers.ray:Ray",
}


def devices_for(launch: "LaunchOptions", visible: int | None = None, asked: int | None = None,
                say: Callable[[str], None] | None = None, ours: tuple[str, ...] = ()) -> Devices:
    """The devices of one node of the run: this machine's, or what a Slurm job or Ray run asks for per node.

    ``asked``: the process count the notebook asks its library for (``Script.processes``), the run's
    when no launch option counts the devices (:func:`nbddp.contracts.devices.notebook_devices`). ``say``: where
    ``--wait`` says what it waits for; without it (a door checking the options before it starts), ``--wait``
    doesn't wait: the run will. ``ours``: GPUs the door's own warm ranks hold (free to it: ``--gpus free``).

    Raises:
        UsageError, DeviceError: before anything starts.
    """
    if launch.slurm is not None:  # (a job's per-node devices are the partition's: Slurm's own defaults)
        from nbddp.launchers.slurm import slurm_devices

        return slurm_devices(launch.slurm, launch.cpu, launch.nproc)
    if launch.ray is not None:  # the cluster's workers: nothing of this machine counts
        from nbddp.launchers.ray import ray_devices

        return ray_devices(launch.ray, launch.cpu, launch.nproc)
    if launch.wait and say is not None:
        return wait_for_free(requested_gpus(launch.gpus), say, ours=ours)
    if launch.wait:
        return Devices("cuda", requested_gpus(launch.gpus) or 1)  # (checked as the run starts, and waited for)
    if asked is None or launch.nproc is not None or launch.gpus is not None:
        return resolve(launch.gpus, launch.cpu, launch.nproc, visible, ours=ours)
    return notebook_devices(asked, launch.cpu, visible)


def topology_notes(launch: "LaunchOptions") -> list[str]:
    """What a user must know before a multi-node run starts (said once, on every node)."""
    cluster = launch.slurm or launch.ray
    if launch.nodes is None and (cluster is None or cluster.nodes == 1):
        return []
    where = f"port {launch.nodes.host_port()[1]} of node 0" if launch.nodes else "a port of the job's first node"
    return [f"note: the rendezvous store listens on {where} on every network interface (torch's TCPStore): "
            "anyone who can reach it can join or disrupt the run. Run multi-node jobs on a trusted network."]


def cluster_launcher_name(launch: "LaunchOptions") -> str | None:
    """The launcher of a cluster's job (``slurm``, ``ray``), or ``None``: the job runs on this machine."""
    if launch.slurm is not None:
        return "slurm"
    if launch.ray is not None:
        return "ray"
    return None


#: The launchers whose jobs run on a cluster's machines (:func:`cluster_launcher_name`).
CLUSTER_LAUNCHERS = ("slurm", "ray")
#: Launchers that may run a job on this machine, one of them picked per job by :func:`launcher_name`.
LOCAL_LAUNCHERS = tuple(name for name in BUILTIN if name not in CLUSTER_LAUNCHERS)


def run_stop_grace(launch: "LaunchOptions") -> float:
    """Seconds between the signal that stops a whole run under ``launch`` (a batch's run, its own ``nbddp run``
    process) and SIGKILL: its launcher's :attr:`~nbddp.launchers.base.Launcher.stop_grace` (the longest of this
    machine's, where the job picks one per run) and :data:`RECORD_SECONDS`."""
    cluster = cluster_launcher_name(launch)
    names = (cluster,) if cluster else LOCAL_LAUNCHERS
    return max(launcher_class(name).stop_grace for name in names) + RECORD_SECONDS


def launcher_name(spec: "JobSpec") -> str:
    """Which launcher runs ``spec``'s job: the one rule."""
    if (cluster := cluster_launcher_name(spec.launch)) is not None:
        return cluster
    if spec.pool is not None:
        return "warm"
    if spawns_its_own_ranks(spec.script.engine):
        return "catalyst-spawn"
    return "torchrun" if spec.launch.nodes is not None or spec.launch.max_restarts else "direct"


def launcher_for(spec: "JobSpec") -> Launcher:
    """The launcher of ``spec``'s job: here, as one node of several, as a Slurm job, or on warm ranks."""
    return launcher_class(launcher_name(spec)).for_job(spec)


def register(name: str, target: str) -> None:
    """Replace the built-in launcher ``name`` in this process with the class at ``target`` (``module:attribute``), as
    an ``nbddp.launchers`` entry point does for every process (a batch's runs and a detached run's supervisor are
    processes of their own: they read entry points).

    Raises:
        UsageError: ``name`` is no launcher's.
    """
    if name not in BUILTIN:
        raise UsageError(f"no launcher is named {name!r}: register() replaces one of {', '.join(BUILTIN)}.")
    plugins.register(ENTRY_POINTS, name, target)


def launcher_class(name: str) -> type[Launcher]:
    """The class registered under ``name``: an ``nbddp.launchers`` entry point (read on the first launch), else the
    built-in one."""
    target = registered(ENTRY_POINTS).get(name) or BUILTIN[name]
    module, _, attribute = target.partition(":")
    return getattr(import_module(module), attribute)
