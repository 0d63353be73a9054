"""This kernel's warm ranks for ``%%ddp_train`` (one pool per kernel, however often the extension is loaded), and
their starter started ahead of the first run: the first thing ``%load_ext nbddp`` does, before it imports the
magics (0.2 s), so that the starter begins importing torch as early as it can."""

from __future__ import annotations

from nbddp.contracts.rank_env import kernel_beside_a_job
from nbddp.launchers.warm.keepers import KernelPool

kernel_pool = KernelPool()


def prepare() -> str:
    """Start the warm ranks' starter unless it or the ranks are there, or this kernel runs beside a job (whose ranks
    are the job's own); the line that says so (``""``: nothing started)."""
    return "" if kernel_beside_a_job() else kernel_pool.prepare()
