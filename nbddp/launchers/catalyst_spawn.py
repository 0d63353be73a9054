"""The Catalyst engine's launcher: the script itself, whose DDP engine spawns the ranks (``mp.spawn``).

The world size travels in ``NBDDP_NPROC`` (see :mod:`nbddp.rank_env`); the ranks' exit codes
come from the spawn's own error report in the launcher log.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from nbddp.devices import Devices
from nbddp.rundir import RunDir

_FAILURE = re.compile(r"process (\d+) terminated with (?:exit code (-?\d+)|signal (SIG\w+))", re.I)
_RAISED = re.compile(r"-- Process (\d+) terminated with the following error")


class CatalystSpawn:
    name = "catalyst-spawn"
    supports_restarts = False
    streams_launcher_log = True

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        return [python, str(script)]

    def rank_exit_codes(self, launcher_log: str) -> dict[int, int]:
        codes: dict[int, int] = {}
        for rank, code, sig in _FAILURE.findall(launcher_log):
            codes[int(rank)] = int(code) if code else -int(getattr(signal, sig, 0))
        for rank in _RAISED.findall(launcher_log):
            codes.setdefault(int(rank), 1)
        return codes

    def root_cause(self, launcher_log: str) -> int | None:
        return None
