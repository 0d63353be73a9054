"""``python -m nbddp.launchers.warm_agent POOL TORCHRUN_ARGS…``: torchrun for a warm pool, which
removes the pool's folder when the process that started the pool is gone.

torchrun itself runs here (its ``main``, as ``python -m torch.distributed.run`` would). A kernel
that is killed outright (a restart, SIGKILL) can't remove its pool's folder; this process outlives
it by the moment torchrun takes to stop the ranks (parent-death signal, see
:mod:`nbddp.launchers.parent_death`), then removes the folder. A pool stopped by its owner is
removed by the owner.
"""

from __future__ import annotations

import shutil
import sys

from nbddp.launchers.pool_dir import PoolDir
from nbddp.launchers.process_groups import process_alive


def main(argv: list[str]) -> None:
    pool = PoolDir(argv[0])
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv[1:])
    finally:
        owner = pool.owner()
        if owner is not None and not process_alive(owner):
            shutil.rmtree(pool.path, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
