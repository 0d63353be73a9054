"""The direct launcher: a run on one machine with no restarts to make starts its ranks itself, without
torchrun's agent (:mod:`nbddp.launchers.direct_main`, about 2 s sooner and 1.8 CPU-seconds cheaper per run).

The ranks are torchrun's all the same (its variables, a session each, the same rank side), meet where any
run on one machine meets (:mod:`nbddp.launchers.private_rendezvous`), and what the launcher saw comes back as
torchrun's report would: each rank's exit code and the first failure. ``--max-restarts`` needs torchrun's
agent (:class:`~nbddp.launchers.torchrun.Torchrun`), as do several nodes.
"""

from __future__ import annotations

from pathlib import Path

from nbddp.contracts.atomic import read_json
from nbddp.contracts.devices import Devices
from nbddp.contracts.rundir import RunDir
from nbddp.launchers import private_rendezvous
from nbddp.launchers.base import TAIL_LINES, Launcher, LaunchReport
from nbddp.contracts.interpreter import module_argv

#: What runs the ranks: nbddp's own starter, which imports torch once and forks them.
LAUNCHER_MODULE = "nbddp.launchers.direct_main"


def starter_options(nproc: int, report: Path) -> list[str]:
    """The starter's options, up to the program the ranks run (``--``, then a script or ``-m MODULE ARGS``)."""
    return ["--nproc", str(nproc), "--report", str(report), "--"]


class Direct(Launcher):
    name = "direct"

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        return module_argv(LAUNCHER_MODULE, *starter_options(devices.nproc, run_dir.launch_report), str(script),
                           python=python)

    def environment(self, run_dir: RunDir) -> dict[str, str]:
        return private_rendezvous.environment(private_rendezvous.prepare(run_dir.store))

    def launch_report(self, run_dir: RunDir) -> Path:
        """Where the starter writes what it saw (:func:`starter_options`' ``--report``)."""
        return run_dir.launch_report

    def observe(self, run_dir: RunDir, expired: bool = False) -> LaunchReport:
        """What the starter wrote (``logs/launch.json``: each rank's exit code, the first failure), and the tail of
        its log (the ranks' output before they open their own logs)."""
        seen = read_json(self.launch_report(run_dir))
        seen = seen if isinstance(seen, dict) else {}
        return LaunchReport(rank_exit_codes={int(rank): int(code)
                                             for rank, code in (seen.get("exit_codes") or {}).items()},
                            root_cause=seen.get("root_cause"),
                            tail="\n".join(self.report(run_dir).splitlines()[-TAIL_LINES:]))
