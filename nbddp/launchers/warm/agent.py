"""``python -m nbddp.launchers.warm.agent POOL STARTER_ARGS…``: the ranks' starter for a warm pool, which
removes the pool's folder once nobody can need it.

nbddp's own starter runs here (:mod:`nbddp.launchers.direct_main`, as for a fresh run on one machine: no
torchrun agent to import torch and meet in a rendezvous first, 2 s). When it ends, the folder goes if its
ranks all left on their own (idle), if the pool's owner asked for the pool to stop for good, or if the
owner is gone: a kernel killed outright (a restart, SIGKILL) can't remove its pool's folder, and this
process outlives it by the moment the starter takes to stop the ranks (parent-death signal, see
:mod:`nbddp.rank_side.parent_death`). After a rank failed while its owner lives, the folder stays: the
owner reads the starter's report there to name the dead rank, then removes it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys

from nbddp.launchers import direct_main
from nbddp.contracts.pool_dir import PoolDir
from nbddp.launchers.process_groups import process_alive


def main(argv: list[str]) -> None:
    pool = PoolDir(argv[0])
    idle = False
    try:
        idle = direct_main.main(argv[1:]) == 0  # every rank returned: none had a job for its idle limit
    finally:
        for _ in range(3):  # a signal landing before they are all ignored interrupts this, once
            try:
                _ignore_stop_signals()
                break
            except BaseException:  # noqa: BLE001 - torchrun's SignalException
                continue
        if idle or pool.stop_mark.exists() or _owner_gone(pool.owner()):
            shutil.rmtree(pool.path, ignore_errors=True)


def _ignore_stop_signals() -> None:
    """Let nothing interrupt the last cleanup: this process is ending anyway.

    A SIGKILLed owner can send more than one parent-death SIGTERM: Linux re-parents this process to
    another of the owner's threads while they die one by one, and each such parent's death signals
    again. Under torchrun's agent each became an exception, and one that landed inside ``rmtree`` left
    the folder half removed (seen in the full test tier, and reproduced on a loaded machine).
    """
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def _owner_gone(owner: int | None) -> bool:
    """The pool's owner (this process's parent) is dead, or dying.

    A killed owner's parent-death signal can bring this process here while the owner is still
    tearing its threads down, not yet a zombie: asking whether it is alive then says yes, and the
    folder would stay (seen once in the full test tier). Linux re-parents this process *before* it
    sends that signal, so a changed parent is the sure sign.
    """
    return owner is not None and (os.getppid() != owner or not process_alive(owner))


if __name__ == "__main__":
    main(sys.argv[1:])
