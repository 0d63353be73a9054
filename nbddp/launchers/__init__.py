"""The launcher seam: how a job's processes are started, and how to read what the launcher reports.

A :class:`Launcher` starts every rank of a job (:meth:`Launcher.start`, returning a :class:`Launch`
the job polls and stops) and reads the launcher's own report back into per-rank exit codes.
Everything else is shared: :class:`nbddp.job.lifecycle.Job` follows and judges whatever was started.

The launchers, chosen in one place (:func:`launcher_for`) by name:

* ``torchrun`` (:class:`~nbddp.launchers.torchrun.Torchrun`): ``torch.distributed.run``, on one
  machine or as one node of several (static rendezvous at node 0);
* ``catalyst-spawn`` (:class:`~nbddp.launchers.catalyst_spawn.CatalystSpawn`): the script itself,
  whose Catalyst engine spawns the ranks with ``mp.spawn``;
* ``slurm`` (:class:`~nbddp.launchers.slurm.Slurm`): a Slurm job, one task per node running either
  of the above;
* ``ray`` (:class:`~nbddp.launchers.ray.Ray`): the ranks on a Ray cluster's workers, one Ray actor
  per rank running the script as torchrun would;
* ``warm`` (:class:`~nbddp.launchers.warm.WarmRanks`): ranks already running (a warm pool), handed
  the job's script.

Another package may register a launcher class under one of these names (or a new one) through
the ``nbddp.launchers`` entry point group; it replaces the built-in one of that name. The tests
use this to watch every front door's runs go through the seam.
"""

from __future__ import annotations

import os
import signal
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from nbddp.devices import Devices, notebook_devices, resolve
from nbddp.engines import spawns_its_own_ranks
from nbddp.job.rundir import RunDir

if TYPE_CHECKING:
    from nbddp.job.lifecycle import JobSpec
    from nbddp.options import LaunchOptions

ENTRY_POINTS = "nbddp.launchers"
BUILTIN = {
    "torchrun": "nbddp.launchers.torchrun:Torchrun",
    "catalyst-spawn": "nbddp.launchers.catalyst_spawn:CatalystSpawn",
    "slurm": "nbddp.launchers.slurm:Slurm",
    "warm": "nbddp.launchers.warm:WarmRanks",
    "ray": "nbddp.launchers.ray:Ray",
}


class Launch(Protocol):
    """A started job's processes, whatever started them: what :class:`~nbddp.job.lifecycle.Job` needs.

    Implemented by :class:`~nbddp.launchers.local_process.LocalProcess` (a launcher process in a
    group of its own), :class:`~nbddp.launchers.local_process.AdoptedGroup` (a group another process
    started) and :class:`~nbddp.launchers.warm_pool.WarmRun` (one job on warm ranks).
    """

    pid: int
    pgid: int
    stopped_by: int | None
    """The signal nbddp stopped it with (``None``: it ended on its own)."""

    def poll(self) -> int | None:
        """The exit code once it ended, else ``None``."""

    def alive(self) -> bool:
        """True while any of its processes runs."""

    def stop(self, sig: int = signal.SIGTERM, grace: float | None = None, reap: bool = False) -> None:
        """``sig``, then SIGKILL after ``grace`` seconds; ``reap``: only clear what an ended launcher left."""


class Launcher:
    """What every launcher answers; the defaults are those of a launcher process on this machine."""

    name = "launcher"
    supports_restarts = False
    """Whether ``--max-restarts`` can be honoured (torchrun restarts ranks; a spawn can't)."""
    streams_launcher_log = False
    """Whether the launcher's own output belongs in the live stream (a spawn's children print there)."""
    stop_grace = 5.0
    """Seconds between SIGTERM and SIGKILL when nbddp stops the launcher (Slurm needs time to cancel)."""
    exit_settle = 1.0
    """Seconds a rank seen gone is given for the launcher to exit with a better report (a crash torchrun
    saw; a job Slurm itself cancelled) before nbddp blames the rank for leaving early."""

    @classmethod
    def for_job(cls, spec: "JobSpec") -> "Launcher":
        """The launcher of ``spec``'s job (:func:`launcher_for` calls this on the chosen class)."""
        return cls()

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        """The argv that starts every rank of the job."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """Variables the ranks need beyond :class:`nbddp.rank_side.env.RankEnv`'s common ones."""
        return {}

    def start(self, script: Path, spec: "JobSpec", rank_env: dict[str, str]) -> Launch:
        """Start every rank of the job: its launcher process in a group of its own, output to the run dir.

        ``rank_env``: the ``NBDDP_*`` variables of this run (:class:`~nbddp.rank_side.env.RankEnv`).
        """
        from nbddp.launchers.local_process import LaunchSpec, LocalProcess

        paths = RunDir(spec.run_dir)
        argv = self.command(script, spec.devices, paths, python=spec.python, max_restarts=spec.launch.max_restarts)
        env = {**os.environ, **rank_env, **self.environment()}
        return LocalProcess(LaunchSpec(tuple(argv), env, spec.cwd, paths.launcher_log, self.stop_grace))

    def report(self, run_dir: RunDir) -> str:
        """The launcher's own output, where its failure reports are."""
        return read_report(run_dir.launcher_log)

    def rank_exit_codes(self, report: str) -> dict[int, int]:
        """Per-rank exit codes from the launcher's failure report (signals as ``-N``)."""
        return {}

    def root_cause(self, report: str) -> int | None:
        """The rank the launcher names as the first failure, if it names one."""
        return None

    def rendezvous_failure(self, report: str, expired: bool = False) -> str | None:
        """Why the nodes of a multi-node run never all met, when that is what happened
        (``expired``: nbddp stopped waiting for them after ``--rdzv-timeout``)."""
        return None

    def ended_by_scheduler(self, run_dir: RunDir) -> str | None:
        """A scheduler's reason for ending the job (Slurm's time limit, an outside scancel…)."""
        return None

    job_record: str | None = None
    """The ``result.json`` field :meth:`job_info` goes into (``None``: no scheduler's job to record)."""

    def job_info(self, run_dir: RunDir) -> dict | None:
        """What ``result.json`` records about a scheduler's job (its id, state, nodes)."""
        return None

    def between_attempts(self, run_dir: RunDir, attempt: int) -> bool:
        """The ranks of ``attempt`` are gone because the job is being run again (a Slurm requeue), not
        because one of them left early."""
        return False


def devices_for(launch: "LaunchOptions", visible: int | None = None, asked: int | None = None) -> Devices:
    """The devices of one node of the run: this machine's, or what a Slurm job or Ray run asks for per node.

    ``asked``: the process count the notebook asks its library for (``Script.processes``), the run's
    when no launch option counts the devices (:func:`nbddp.devices.notebook_devices`).

    Raises:
        UsageError, DeviceError: before anything starts.
    """
    if launch.slurm is not None:  # (a job's per-node devices are the partition's: Slurm's own defaults)
        from nbddp.launchers.slurm import slurm_devices

        return slurm_devices(launch.slurm, launch.cpu, launch.nproc)
    if launch.ray is not None:  # the cluster's workers: nothing of this machine counts
        from nbddp.launchers.ray import ray_devices

        return ray_devices(launch.ray, launch.cpu, launch.nproc)
    if asked is None or launch.nproc is not None or launch.gpus is not None:
        return resolve(launch.gpus, launch.cpu, launch.nproc, visible)
    return notebook_devices(asked, launch.cpu, visible)


def launcher_name(spec: "JobSpec") -> str:
    """Which launcher runs ``spec``'s job: the one rule."""
    if spec.launch.slurm is not None:
        return "slurm"
    if spec.launch.ray is not None:
        return "ray"
    if spec.pool is not None:
        return "warm"
    return "catalyst-spawn" if spawns_its_own_ranks(spec.script.engine) else "torchrun"


def launcher_for(spec: "JobSpec") -> Launcher:
    """The launcher of ``spec``'s job: here, as one node of several, as a Slurm job, or on warm ranks."""
    return launcher_class(launcher_name(spec)).for_job(spec)


_registered: dict[str, str] | None = None


def launcher_class(name: str) -> type[Launcher]:
    """The class registered under ``name``: an ``nbddp.launchers`` entry point, else the built-in one."""
    global _registered
    if _registered is None:  # read once, on the first launch (never at import)
        from importlib.metadata import entry_points

        _registered = {entry.name: entry.value for entry in entry_points(group=ENTRY_POINTS)}
    target = _registered.get(name) or BUILTIN[name]
    module, _, attribute = target.partition(":")
    return getattr(import_module(module), attribute)


def read_report(path: Path) -> str:
    """A launcher's log (``""`` when it wrote none)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
