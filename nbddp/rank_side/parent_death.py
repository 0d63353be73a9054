"""``python -m nbddp.rank_side.parent_death PARENT_PID -- COMMAND...``: die with the parent, then exec COMMAND.

The launcher (torchrun, or the Catalyst script) is a child of the CLI or of
the Jupyter kernel. If that parent dies without stopping it (kernel restart,
SIGKILL), Linux's parent-death signal delivers SIGTERM to it; torchrun then
stops its ranks, and each rank has a SIGKILL tied to torchrun's death (see
:mod:`nbddp.rank_side.process`). The setting survives ``exec``, so this costs one
short-lived Python start and no ``preexec_fn`` in a threaded kernel.

Caveat: Linux ties the signal to the parent *thread* that started the
process, so launch from a thread that lives as long as the run.

It sits on the rank side, the lowest of its users: each rank arms it for itself, and the launchers,
which may import the rank side, run it as a module.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from nbddp.contracts.status import signal_exit_code
from nbddp.contracts.rank_env import VARIABLES

PR_SET_PDEATHSIG = 1
#: The variable a launcher process sets to its own pid for its ranks (each rank then to its own, for what it
#: starts): the parent a rank must still have once its death signal is armed (:class:`RankEnv`'s ``parent``).
PARENT = VARIABLES["parent"]


def arm(sig: int) -> None:
    """Have Linux send ``sig`` to this process when its parent dies (elsewhere: nothing). The one place
    nbddp asks for it: here for the launcher, and in each rank (:mod:`nbddp.rank_side.process`)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass


def die_with_parent(always: bool = False) -> None:
    """In a rank: be SIGKILLed when the process that started it dies, and if that process is gone already,
    end now. A rank an nbddp launcher started (its pid in :data:`PARENT`) calls this first thing, before
    torch is imported (:mod:`nbddp.runtime`, :mod:`nbddp.runtime_catalyst`, :mod:`nbddp.rank_side.warm.loop`);
    every rank calls it again once it knows it is one (``always``: :func:`nbddp.rank_side.process.become_rank`,
    which arms the signal under any launcher: Slurm's, Ray's, a person's own torchrun).

    Arming alone is not enough: a launcher that dies while its rank's interpreter starts (a kernel killed by
    the OOM killer while it forks thousands of ranks) signals nobody, and its orphan would train on,
    re-parented to init. So the parent is checked *after* arming: if it is no longer the launcher, the
    signal will never come and the rank exits. What the rank starts that imports nbddp in turn (DataLoader
    workers importing the training's modules) is tied to the rank the same way: :data:`PARENT` becomes the
    rank's own pid.

    SIGKILL, not SIGTERM: libraries catch SIGTERM to save a checkpoint at their next step (Lightning does),
    and once the launcher is gone a rank that waits for that would outlive its run.
    """
    expected = os.environ.get(PARENT, "")
    if expected == str(os.getpid()):
        return  # armed and checked already
    if not expected.isdigit():
        if always:
            arm(signal.SIGKILL)
        return
    arm(signal.SIGKILL)
    if os.getppid() != int(expected):
        os._exit(signal_exit_code(signal.SIGKILL))  # the launcher is gone: the signal will never come
    os.environ[PARENT] = str(os.getpid())


def launching_ranks() -> None:
    """In a launcher process (torchrun's agent, Catalyst's spawning script), before it starts ranks: name
    itself as their parent (:data:`PARENT`), which each rank checks once its death signal is armed."""
    os.environ[PARENT] = str(os.getpid())


def main(argv: list[str]) -> None:
    parent, command = int(argv[0]), argv[argv.index("--") + 1:]
    arm(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the signal was armed
        sys.exit(signal_exit_code(signal.SIGTERM))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
