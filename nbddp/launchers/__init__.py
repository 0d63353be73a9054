"""The launcher seam: how a job's processes are started, and how to read what the launcher reports.

A :class:`Launcher` turns a written script, the devices and the run dir into the command that
starts every rank, and reads the launcher's own output back into per-rank exit codes. Everything
else is shared: :class:`nbddp.launchers.local_process.Launch` owns the local process (one process group,
parent-death signal, SIGTERM → grace → SIGKILL), :class:`nbddp.job.lifecycle.Job` follows and judges.

The implementations, chosen in one place (:func:`launcher_for`):

* :class:`~nbddp.launchers.torchrun.Torchrun`: ``torch.distributed.run``, on one machine or as one
  node of several (static rendezvous at node 0);
* :class:`~nbddp.launchers.catalyst_spawn.CatalystSpawn`: the script itself, whose Catalyst engine
  spawns the ranks with ``mp.spawn`` (one machine, or one node of several);
* :class:`~nbddp.launchers.slurm.Slurm`: a Slurm job, one task per node running either of the above.

``nbddp run``, ``%%ddp_train`` and ``nbddp batch`` never look past this interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from nbddp.devices import Devices, resolve
from nbddp.options import DEFAULT_RDZV_TIMEOUT
from nbddp.job.rundir import RunDir

if TYPE_CHECKING:
    from nbddp.options import LaunchOptions, Nodes, SlurmRequest


class Launcher:
    """What every launcher answers; the defaults are those of a launcher running on this machine."""

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

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        """The argv that starts every rank of the job."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """Variables the ranks need beyond :class:`nbddp.rank_side.env.RankEnv`'s common ones."""
        return {}

    def report(self, run_dir: RunDir) -> str:
        """The launcher's own output, where its failure reports are."""
        return _read(run_dir.launcher_log)

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

    def job_info(self, run_dir: RunDir) -> dict | None:
        """What ``result.json`` records about a scheduler's job (its id, state, nodes)."""
        return None


def devices_for(launch: "LaunchOptions", visible: int | None = None) -> Devices:
    """The devices of one node of the run: this machine's, or what a Slurm job asks for per node.

    Raises:
        UsageError, DeviceError: before anything starts.
    """
    if launch.slurm is not None:
        from nbddp.launchers.slurm import slurm_devices

        return slurm_devices(launch.slurm, launch.cpu, launch.nproc)
    return resolve(launch.gpus, launch.cpu, launch.nproc, visible)


def launcher_for(engine: str, nodes: "Nodes | None" = None, slurm: "SlurmRequest | None" = None,
                 rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT) -> Launcher:
    """The launcher of an engine's scripts: here, as one node of several, or as a Slurm job."""
    if slurm is not None:
        from nbddp.launchers.slurm import Slurm

        return Slurm(engine, slurm, rdzv_timeout)
    if engine == "catalyst":
        from nbddp.launchers.catalyst_spawn import CatalystSpawn

        return CatalystSpawn(nodes, rdzv_timeout)
    from nbddp.launchers.torchrun import Torchrun

    return Torchrun(nodes, rdzv_timeout)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
