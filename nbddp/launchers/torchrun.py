"""``torch.distributed.run`` (torchrun) on one machine: the torch engine's launcher."""

from __future__ import annotations

import re
from pathlib import Path

from nbddp.devices import Devices
from nbddp.rundir import RunDir

_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


class Torchrun:
    name = "torchrun"
    supports_restarts = True
    streams_launcher_log = False

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        """A fresh c10d store on an OS-chosen free port (``--standalone``: two runs at once never collide).

        torchrun runs in its own process, never ``elastic_launch`` inside the kernel (it replaces the
        kernel's SIGINT handler). ``--log-dir`` keeps torchrun's folder in the run dir: without it,
        every run leaves a ``torchelastic_*`` folder in the system temp folder.
        """
        return [
            python, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={devices.nproc}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1", f"--log-dir={run_dir.torchrun_logs}", str(script),
        ]

    def rank_exit_codes(self, launcher_log: str) -> dict[int, int]:
        return {int(rank): int(code) for rank, code in _FAILURE.findall(launcher_log)}

    def root_cause(self, launcher_log: str) -> int | None:
        _, found, tail = launcher_log.rpartition("Root Cause (first observed failure)")
        match = re.search(r"rank\s*:\s*(\d+)", tail) if found else None
        return int(match.group(1)) if match else None
