"""``python -m nbddp.launchers.direct_main --nproc N --report PATH -- SCRIPT`` (or ``-- -m MODULE ARGS``): start
N ranks of SCRIPT on this machine, as torchrun would, without torchrun's agent.

On one machine with no restarts to make, torchrun's agent only starts the ranks and watches them, and it
costs every run what it costs to import torch and to meet in its rendezvous: about 2 s and 1.8 CPU-seconds
before the first rank starts (measured on 2 cores: a trivial 2-rank job, 3.9-5.2 s under torchrun, 1.8-2.3 s
started directly). This process imports torch once and forks each rank from itself
(:mod:`nbddp.launchers.forked_rank`: one import of torch per run rather than one per rank, half the CPU time
of starting two ranks), gives each rank torchrun's variables (:func:`nbddp.engines.torch.torchrun_variables`)
and a session of its own (as torchrun does, so a terminal's Ctrl-C reaches only nbddp), and watches the ranks
every :data:`MONITOR_SECONDS`. A rank that has ended leaves nothing in its session (its DataLoader workers are
stopped with it). When a rank fails
(a non-zero exit, a signal) the others get SIGTERM, then SIGKILL after :data:`STOP_SECONDS`; a SIGTERM, SIGINT
or SIGHUP to this process does the same to every rank. Each rank dies with this process (its parent-death
signal, checked once armed: :func:`nbddp.rank_side.parent_death.die_with_parent`).

What it saw is ``PATH`` (JSON): each rank's exit code (a signal as ``-N``) and the first failure, the root cause,
which :class:`nbddp.launchers.direct.Direct` hands the job as torchrun's report would be.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

from nbddp.contracts.atomic import write_json
from nbddp.engines.torch import LOOPBACK, torchrun_variables
from nbddp.contracts.status import signal_exit_code
from nbddp.launchers import forked_rank
from nbddp.contracts.process_groups import STOP_GRACE, signal_group
from nbddp.contracts.ports import free_port
from nbddp.contracts.rank_env import threads_per_rank
from nbddp.rank_side.parent_death import launching_ranks

MONITOR_SECONDS = 0.05
#: Between the SIGTERM that stops the ranks and the SIGKILL for those still there.
STOP_SECONDS = STOP_GRACE


class Ranks:
    def __init__(self, program: Sequence[str], nproc: int) -> None:
        """``program``: what follows ``python -u`` for each rank (a script, or ``-m MODULE ARGS``)."""
        port = free_port(LOOPBACK)  # nothing listens on it (the ranks meet in files): for libraries that read it
        forked_rank.preload(threads_per_rank(nproc), forked_rank.RANK_IMPORTS)
        base = dict(os.environ)
        self.procs = [forked_rank.start(program, {**base, **torchrun_variables(
                          rank, rank, nproc, master=(LOOPBACK, port), run_id=f"nbddp-{os.getpid()}")})
                      for rank in range(nproc)]
        self.codes: dict[int, int] = {}
        self.root_cause: int | None = None
        self.stopped_by: int | None = None

    def watch(self) -> None:
        """Until every rank has exited: a failed one stops the rest, as does a signal to this process."""
        stopping_since: float | None = None
        while len(self.codes) < len(self.procs):
            for rank, proc in enumerate(self.procs):
                if rank not in self.codes and (code := proc.poll()) is not None:
                    self.codes[rank] = code
                    signal_group(proc.pid, signal.SIGKILL)  # what the rank left in its session: its DataLoader
                    # workers (a forked rank ends with os._exit, before multiprocessing would stop them; they would
                    # notice only at their next 5 s check), whatever its code started there
                    if code != 0 and self.root_cause is None and stopping_since is None:
                        self.root_cause = rank  # the first failure seen: not the SIGTERMs sent to the others
            if stopping_since is None and (self.stopped_by is not None or self.root_cause is not None):
                stopping_since = time.monotonic()
                self._signal(signal.SIGTERM)
            elif stopping_since is not None and time.monotonic() - stopping_since > STOP_SECONDS:
                self._signal(signal.SIGKILL)
            time.sleep(MONITOR_SECONDS)

    def on_signal(self, signum: int, frame: object) -> None:
        if self.stopped_by is None:
            self.stopped_by = signum

    def _signal(self, sig: int) -> None:
        for rank, proc in enumerate(self.procs):
            if rank not in self.codes:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def report(self) -> dict:
        return {"exit_codes": {str(rank): code for rank, code in sorted(self.codes.items())},
                "root_cause": self.root_cause, "stopped_by": self.stopped_by}

    def exit_code(self) -> int:
        if self.stopped_by is not None:
            return signal_exit_code(self.stopped_by)
        return 0 if all(code == 0 for code in self.codes.values()) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbddp.launchers.direct_main",
                                     description="Start SCRIPT's ranks on this machine, as torchrun would.")
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--report", type=Path, required=True, help="where to write what was seen (JSON)")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- SCRIPT, or -- -m MODULE ARGS")
    args = parser.parse_args(argv)
    launching_ranks()
    ranks = Ranks(args.program[1:] if args.program[:1] == ["--"] else args.program, args.nproc)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, ranks.on_signal)
    try:
        ranks.watch()
    finally:
        write_json(args.report, ranks.report())
    if ranks.root_cause is not None:  # (the job says it better, from this report; the log keeps it too)
        print(f"[launcher] rank {ranks.root_cause} failed first (exit code {ranks.codes[ranks.root_cause]}); every "
              f"rank's exit code: {ranks.report()['exit_codes']}", flush=True)
    return ranks.exit_code()


if __name__ == "__main__":
    sys.exit(main())
