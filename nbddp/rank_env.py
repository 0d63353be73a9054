"""The environment nbddp gives every rank, written and read in one place.

The launcher side builds a :class:`RankEnv` and turns it into the ``env`` of the launcher's
``Popen`` (this process's own ``os.environ`` is never changed); the rank side reads it back with
:meth:`RankEnv.from_environ`. Without a launcher (``python train.py``, a kernel) every field is
empty and the runtime degrades to a plain single process. Nothing here imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from nbddp.rundir import RunDir


@dataclass(frozen=True)
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

    def to_environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` plus every variable of this environment, for ``Popen(env=...)``."""
        env = dict(base)
        for name, value in (("NBDDP_RUN_DIR", self.run_dir), ("NBDDP_DEVICE", self.device),
                            ("NBDDP_NPROC", self.nproc), ("NBDDP_CHECKPOINT", self.checkpoint),
                            ("NBDDP_COLLECTIVE_TIMEOUT", self.collective_timeout)):
            if value is None or value == "":
                env.pop(name, None)
            else:
                env[name] = str(value)
        env["PYTHONUNBUFFERED"] = "1"
        if "OMP_NUM_THREADS" not in env and self.nproc:  # torchrun would set 1 and warn about it
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.nproc))
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "RankEnv":
        environ = os.environ if environ is None else environ
        run_dir, checkpoint = environ.get("NBDDP_RUN_DIR"), environ.get("NBDDP_CHECKPOINT")
        nproc, timeout = environ.get("NBDDP_NPROC"), environ.get("NBDDP_COLLECTIVE_TIMEOUT")
        return cls(
            run_dir=RunDir(Path(run_dir)) if run_dir else None,
            device=environ.get("NBDDP_DEVICE", ""),
            nproc=int(nproc) if nproc else None,
            checkpoint=Path(checkpoint) if checkpoint else None,
            collective_timeout=float(timeout) if timeout and float(timeout) > 0 else None,
        )
