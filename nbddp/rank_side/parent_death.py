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

from nbddp.job.status import signal_exit_code

PR_SET_PDEATHSIG = 1


def arm(sig: int) -> None:
    """Have Linux send ``sig`` to this process when its parent dies (elsewhere: nothing). The one place
    nbddp asks for it: here for the launcher, and in each rank (:mod:`nbddp.rank_side.process`)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    parent, command = int(argv[0]), argv[argv.index("--") + 1:]
    arm(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the signal was armed
        sys.exit(signal_exit_code(signal.SIGTERM))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
