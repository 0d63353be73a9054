"""This kernel's warm ranks for ``%%ddp_train`` (one pool per kernel, however often the extension is loaded), in a
module of their own: ``%load_ext nbddp`` starts their starter ahead of the first run (:meth:`KernelPool.prepare`)
before it imports the magics (0.2 s), so that the starter begins importing torch as early as it can."""

from __future__ import annotations

from nbddp.launchers import KernelPool

kernel_pool = KernelPool()
