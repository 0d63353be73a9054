"""How a job ended, judged from evidence alone: a pure function, table-tested branch by branch.

:class:`nbddp.job.lifecycle.Job` gathers the :class:`Evidence` once its processes are gone (exit codes from
the launcher's report, the ranks' error reports and done marks, whether the weights were written,
whether nbddp itself stopped the job and why); :func:`judge` turns it into a :class:`JobOutcome`.
The judgement never trusts an exit status alone: a job nbddp stopped is *interrupted* or *timed
out* even when Catalyst's children exit 0 after a signal, and a zero exit without the weights the
job promised is a failure.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import Any

from nbddp.job.record import RankError, describe_exit
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.status import Status, signal_exit_code
from nbddp.contracts.errors import RunError, see

#: gloo's "Timed out waiting Nms for recv", NCCL's watchdog; not "timed out connecting" (a start-up failure).
COLLECTIVE_TIMEOUT = re.compile(r"timed out waiting|collective operation timeout|watchdog caught", re.IGNORECASE)
COLLECTIVE_ERRORS = ("RuntimeError", "DistBackendError", "DistError", "DistStoreError", "DistNetworkError")
#: What a rank reports when a *peer* vanished: the peer, not this rank, is the root cause.
PEER_GONE = re.compile(r"closed by peer|reset by peer|broken pipe|connection (?:closed|reset|refused)", re.IGNORECASE)


@dataclass
class JobOutcome:
    status: Status
    exit_code: int
    launcher_exit: int | None
    rank_exit_codes: dict[int, int] = field(default_factory=dict)
    errors: list[RankError] = field(default_factory=list)
    message: str = ""
    final_metrics: dict[str, Any] = field(default_factory=dict)
    rank: int | None = None
    """The rank the failure is blamed on, when there is one."""


@dataclass(frozen=True)
class Evidence:
    """Everything :func:`judge` looks at, gathered once the job's processes have ended."""

    run_dir: RunDir
    notebook: str
    launcher_exit: int | None
    rank_exit_codes: dict[int, int] = field(default_factory=dict)
    """From the launcher's failure report; signals as negative numbers."""
    errors: tuple[RankError, ...] = ()
    """The ranks' uncaught exceptions of the latest attempt, earliest first."""
    done_ranks: frozenset[int] = frozenset()
    checkpoint_exists: bool = False
    root_cause: int | None = None
    """The rank torchrun names as the first observed failure."""
    launcher_tail: str = ""
    stop_requested: bool = False
    """``nbddp kill`` asked this run to stop."""
    timed_out: bool = False
    idle_for: float | None = None
    deadline_name: str = "--timeout"
    """The time limit that ran out, when one did (papermill's ``--execution-timeout`` for its cell)."""
    """Set when the timeout was ``--idle-timeout`` (its seconds)."""
    interrupted_by: int | None = None
    """The signal that interrupted nbddp itself (a Ctrl-C, a SIGTERM to ``nbddp run``, the stop button)."""
    stopped_by: int | None = None
    """The signal nbddp sent to stop the launcher, for whatever reason (an interruption, a timeout, a rank
    gone early); ``None`` when the launcher ended on its own."""
    early_exit: int | None = None
    """A rank seen gone with neither a done mark nor an error report while the others ran."""
    collective_timeout: float | None = None
    nproc: int = 1
    """The ranks this launcher ran (one node's, in a multi-node run), numbered from ``first_rank``."""
    first_rank: int = 0
    checkpoint_expected: bool = True
    """False on nodes 1 and up of a multi-node run (node 0's rank 0 saves the weights, on node 0), and for a
    script that returns nothing (:attr:`nbddp.notebook.script.Script.returns`)."""
    final_metrics: dict[str, Any] = field(default_factory=dict)
    rendezvous_failure: str | None = None
    """Why the nodes of a multi-node run never all met (the launcher's reading of torch's store error)."""
    scheduler_end: str | None = None
    """A scheduler ended the job itself (Slurm's time limit, an outside scancel, a node failure…): its reason."""
    node_gone: dict[str, Any] | None = None
    """The node of a multi-node run whose ranks stopped answering (its roster entry)."""
    warm: bool = False
    """The ranks are a warm pool's: stopping the run stops their job, not them (:func:`stopped`)."""

    @property
    def stopped_by_us(self) -> bool:
        return self.stopped_by is not None

    @property
    def peer_gone(self) -> bool:
        """The first error says a peer vanished: that peer, not the reporter, is the root cause."""
        return bool(self.errors) and bool(PEER_GONE.search(self.errors[0].message))


def stopped(warm: bool) -> str:
    """What a stop did to the ranks: a fresh run's end with it; warm ranks only leave the job (and wait for the
    next)."""
    return "every rank's job was stopped" if warm else "every rank was stopped"


def judge(e: Evidence) -> JobOutcome:
    """The outcome of a job, from what it left behind; the first rule that applies wins."""
    codes = dict(e.rank_exit_codes)
    for error in e.errors:
        codes.setdefault(error.rank, 1)
    errors = list(e.errors)

    def outcome(status: Status, message: str, code: int | None = None, rank: int | None = None) -> JobOutcome:
        return JobOutcome(status, status.exit_code if code is None else code, e.launcher_exit, codes, errors,
                          message, e.final_metrics, rank)

    if e.interrupted_by is None and not e.timed_out and e.stop_requested:
        return outcome(Status.INTERRUPTED, f"stopped by `nbddp kill`; {stopped(e.warm)}.",
                       signal_exit_code(signal.SIGTERM))
    if e.scheduler_end and e.interrupted_by is None and not e.timed_out:
        return outcome(Status.FAILED, e.scheduler_end)
    if e.rendezvous_failure and not errors:
        return outcome(Status.FAILED, e.rendezvous_failure)
    # SIGTERMs come from whoever stops the survivors (torchrun, spawn, or us): never the root cause.
    signalled = {r: c for r, c in codes.items() if c < 0 and c != -signal.SIGTERM}
    if signalled and (not errors or e.peer_gone) and not e.timed_out and e.interrupted_by is None \
            and (not e.stopped_by_us or e.early_exit is not None):
        rank = e.root_cause if e.root_cause in signalled else min(signalled)
        return outcome(Status.FAILED, death_message(e, rank, signalled[rank]), rank=rank)
    if e.early_exit is not None:
        rank = e.early_exit
        return outcome(Status.FAILED, (
            f"rank {rank} ended before the training finished, without an error, while the other ranks were still "
            f"running (they would have waited for it in a collective). Look for sys.exit(), os._exit() or a return "
            f"path that skips work on some ranks; its log: {e.run_dir.rank_log(rank)}"), rank=rank)
    if e.node_gone is not None and e.interrupted_by is None and not e.timed_out:
        node = e.node_gone
        first, last = node.get("ranks", ["?", "?"])
        return outcome(Status.FAILED, (
            f"node {node.get('node')} ({node.get('host')}, ranks {first}-{last}) went away while training: its ranks "
            f"stopped answering (rank {errors[0].rank}: {gist(errors[0].message)}), so this node's ranks were "
            f"stopped. See that node's own output" + (f" and its run dir {node['run_dir']}" if node.get("run_dir")
                                                       else "") + "."), rank=errors[0].rank)
    if e.timed_out:
        return outcome(Status.TIMEOUT, (
            f"no rank printed or logged anything for {e.idle_for:g}s (--idle-timeout): stopped. A stuck data loader "
            "or a deadlock outside collectives?") if e.idle_for else (
            f"the run exceeded {e.deadline_name}; {stopped(e.warm)}."
            + (f" {e.scheduler_end}" if e.scheduler_end else "")))
    if errors and COLLECTIVE_TIMEOUT.search(errors[0].message) and errors[0].type in COLLECTIVE_ERRORS:
        limit = f" (--collective-timeout {e.collective_timeout:g}s)" if e.collective_timeout else ""
        return outcome(Status.TIMEOUT, (
            f"a collective timed out{limit}: rank {errors[0].rank} waited for peers that never joined — did a rank "
            f"skip an all_reduce, or stall?{see('a-collective-timed-out')}\n\n" + failure_message(e, codes)),
            rank=errors[0].rank)
    interrupted_by = e.interrupted_by or e.stopped_by  # (a timeout was judged above)
    if interrupted_by is not None:
        said = f" {e.scheduler_end}" if e.scheduler_end else ""  # (a Ray run stopped while waiting to be placed)
        return outcome(Status.INTERRUPTED, f"interrupted by {signal.Signals(interrupted_by).name}; {stopped(e.warm)}."
                       f"{said}", signal_exit_code(interrupted_by))
    if e.launcher_exit == 0 and (e.checkpoint_exists or not e.checkpoint_expected) and not errors:
        codes = {r: 0 for r in range(e.first_rank, e.first_rank + e.nproc)} | codes
        return JobOutcome(Status.SUCCEEDED, 0, e.launcher_exit, codes, [], "", e.final_metrics)
    message = failure_message(e, codes)
    # Bad input found by the launcher before any rank started (Catalyst's pickling check): exit 2; a rank
    # without a GPU of its own (nbddp.contracts.devices.rank_gpu): exit 3, as for devices refused before the start.
    from nbddp.contracts.errors import DeviceError

    bad_input = not errors and "UnpicklableError:" in message
    no_device = bool(errors) and errors[0].type == DeviceError.__name__
    return outcome(Status.FAILED, message, 2 if bad_input else DeviceError.exit_code if no_device else 1,
                   rank=errors[0].rank if errors else None)


def gist(message: str) -> str:
    """The first sentence of a backend error, without gloo's ``[.../pair.cc:553]`` source location."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", message.strip().splitlines()[-1] if message.strip() else "")
    return text.split(". ")[0][:160]


def failure_message(e: Evidence, codes: dict[int, int]) -> str:
    if e.errors:
        first = e.errors[0]
        # (its traceback, translated to notebook cells, was shown as it streamed: see nbddp.job.rank_output)
        return f"{first.headline(e.notebook)}\nFull log: {e.run_dir.rank_log(first.rank)}"
    dead = {r: c for r, c in codes.items() if c != 0}
    if dead:
        return death_message(e, *min(dead.items()))
    if e.launcher_exit == 0:
        return (f"the ranks exited without saving the returned weights ({e.run_dir.weights.name}). "
                f"A rank may have exited early; see the logs in {e.run_dir.logs}")
    raised = [line for line in e.launcher_tail.splitlines()
              if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*:", line)]
    headline = f"{raised[-1]}\n\n" if raised else ""
    return f"{headline}the launcher failed ({describe_exit(e.launcher_exit or 1)}); its last output:\n{e.launcher_tail}"


def death_message(e: Evidence, rank: int, exit_code: int) -> str:
    """A rank that ended badly; told truthfully when it had finished its training first."""
    log = e.run_dir.rank_log(rank)
    if rank not in e.done_ranks:
        return f"rank {rank} died: {describe_exit(exit_code)}. Its last output is in {log}."
    how = signal.Signals(-exit_code).name if exit_code < 0 and -exit_code in signal.valid_signals() \
        else describe_exit(exit_code)
    kept = f"The trained weights are kept in {e.run_dir.weights}. " if e.checkpoint_exists else ""
    return (f"rank {rank} finished training, then crashed while exiting ({how}): a defect in the process's "
            f"teardown, not in the training. {kept}Its last output is in {log}.")


def run_error(outcome: JobOutcome, run_dir: RunDir) -> RunError:
    """The exception for an outcome that isn't success, carrying what was judged."""
    from nbddp.contracts.errors import error_for

    first = outcome.errors[0] if outcome.errors else None
    return error_for(outcome.status, outcome.message, outcome.exit_code, str(run_dir), rank=outcome.rank,
                     exc_type=first.type if first else None, exc_message=first.message if first else None,
                     cell=first.cell if first else None, line=first.line if first else None)
