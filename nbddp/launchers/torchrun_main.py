"""``python -m nbddp.launchers.torchrun_main TORCHRUN_ARGS…``: torchrun, as ``python -m torch.distributed.run``
runs it, without the garbage collection of its interpreter's shutdown (~0.3 s with torch imported).

nbddp waits for torchrun's exit status before it judges a run and loads the weights, so torchrun's
exit sits on the path between the last training step and the kernel. Nothing torchrun made needs
collecting once it returns (see :func:`nbddp.rank_side.process.skip_final_collection`).
"""

from __future__ import annotations

import gc
import sys


def main(argv: list[str]) -> None:
    from nbddp.rank_side.parent_death import launching_ranks
    from torch.distributed.run import main as torchrun

    launching_ranks()
    try:
        torchrun(argv)
    finally:
        gc.freeze()


if __name__ == "__main__":
    main(sys.argv[1:])
