"""``python -m nbddp.launchers.warm_agent POOL TORCHRUN_ARGS…``: torchrun for a warm pool, which
removes the pool's folder once nobody can need it.

torchrun itself runs here (its ``main``, as ``python -m torch.distributed.run`` would). When it
ends, the folder goes if its ranks all left on their own (idle), if the pool's owner asked for
the pool to stop for good, or if the owner is gone: a kernel killed outright (a restart, SIGKILL)
can't remove its pool's folder, and this process outlives it by the moment torchrun takes to stop
the ranks (parent-death signal, see :mod:`nbddp.launchers.parent_death`). After a rank failed while
its owner lives, the folder stays: the owner reads torchrun's report there to name the dead rank,
then removes it.
"""

from __future__ import annotations

import shutil
import sys

from nbddp.launchers.pool_dir import PoolDir
from nbddp.launchers.process_groups import process_alive


def main(argv: list[str]) -> None:
    pool = PoolDir(argv[0])
    from torch.distributed.run import main as torchrun

    idle = False
    try:
        torchrun(argv[1:])
        idle = True  # every rank returned: none had a job for its idle limit
    finally:
        owner = pool.owner()
        if idle or pool.stop_mark.exists() or (owner is not None and not process_alive(owner)):
            shutil.rmtree(pool.path, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
