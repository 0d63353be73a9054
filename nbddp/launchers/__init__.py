"""The launcher seam: how a job's processes are started, and how to read what the launcher reports.

A :class:`Launcher` turns a written script, the devices and the run dir into the command that
starts every rank, and reads the launcher's own log back into per-rank exit codes. Everything else
is shared: :class:`nbddp.launch.Launch` owns the processes (one process group, parent-death
signal, SIGTERM → grace → SIGKILL), :class:`nbddp.job.Job` follows and judges them.

Two implementations today, chosen in one place (:func:`launcher_for`):

* :class:`~nbddp.launchers.torchrun.Torchrun`: ``torch.distributed.run`` on one machine (the torch engine);
* :class:`~nbddp.launchers.catalyst_spawn.CatalystSpawn`: the script itself, whose Catalyst engine
  spawns the ranks with ``mp.spawn`` (the catalyst engine).

A new launcher (torchrun across nodes, Slurm, warm ranks) is one more class here, and one more
branch in :func:`launcher_for`; ``nbddp run``, ``%%ddp_train`` and ``nbddp batch`` don't change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from nbddp.devices import Devices
from nbddp.rundir import RunDir


class Launcher(Protocol):
    name: str
    supports_restarts: bool
    """Whether ``--max-restarts`` can be honoured (torchrun restarts ranks; a spawn can't)."""
    streams_launcher_log: bool
    """Whether the launcher's own output belongs in the live stream (a spawn's children print there)."""

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        """The argv that starts every rank of the job."""

    def rank_exit_codes(self, launcher_log: str) -> dict[int, int]:
        """Per-rank exit codes from the launcher's failure report (signals as ``-N``)."""

    def root_cause(self, launcher_log: str) -> int | None:
        """The rank the launcher names as the first failure, if it names one."""


def launcher_for(engine: str) -> Launcher:
    """The launcher of an engine's scripts."""
    if engine == "catalyst":
        from nbddp.launchers.catalyst_spawn import CatalystSpawn

        return CatalystSpawn()
    from nbddp.launchers.torchrun import Torchrun

    return Torchrun()
