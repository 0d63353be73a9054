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

from nbddp.job.rundir import RunDir


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
    nnodes: int | None = None
    """``NBDDP_NNODES``: nodes of a multi-node run (Catalyst's engine reads it; torchrun has its own)."""
    node_rank: int | None = None
    """``NBDDP_NODE_RANK``: this node's rank in a multi-node run."""
    master: str = ""
    """``NBDDP_MASTER``: ``HOST:PORT`` of node 0's rendezvous (Catalyst's rank 0 listens there)."""
    rdzv_timeout: float | None = None
    """``NBDDP_RDZV_TIMEOUT``: how long a multi-node rank waits for the others to join."""

    def to_environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` plus every variable of this environment, for ``Popen(env=...)``."""
        env = dict(base)
        for name, value in (("NBDDP_RUN_DIR", self.run_dir), ("NBDDP_DEVICE", self.device),
                            ("NBDDP_NPROC", self.nproc), ("NBDDP_CHECKPOINT", self.checkpoint),
                            ("NBDDP_COLLECTIVE_TIMEOUT", self.collective_timeout), ("NBDDP_NNODES", self.nnodes),
                            ("NBDDP_NODE_RANK", self.node_rank), ("NBDDP_MASTER", self.master),
                            ("NBDDP_RDZV_TIMEOUT", self.rdzv_timeout)):
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
        nnodes, node_rank, rdzv = environ.get("NBDDP_NNODES"), environ.get("NBDDP_NODE_RANK"), environ.get("NBDDP_RDZV_TIMEOUT")
        return cls(
            run_dir=RunDir(Path(run_dir)) if run_dir else None,
            device=environ.get("NBDDP_DEVICE", ""),
            nproc=int(nproc) if nproc else None,
            checkpoint=Path(checkpoint) if checkpoint else None,
            collective_timeout=float(timeout) if timeout and float(timeout) > 0 else None,
            nnodes=int(nnodes) if nnodes else None,
            node_rank=int(node_rank) if node_rank else None,
            master=environ.get("NBDDP_MASTER", ""),
            rdzv_timeout=float(rdzv) if rdzv else None,
        )
