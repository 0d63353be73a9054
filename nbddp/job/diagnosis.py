"""A run that failed where the machine is the usual cause (its rendezvous, its first collective, shared memory, open
files) ends with the doctor's check that explains it, run then for that check alone, within its time limit.

So the ending line says "NCCL hangs with peer-to-peer between the GPUs … Fix: export NCCL_P2P_DISABLE=1" or
"/dev/shm has 64 MiB free … Fix: --shm-size", not only a backend's message; and when the check passes on this
machine, that the cause is in the run rather than the machine. Which check explains which failure is
:func:`explaining_check`'s table, from the judged outcome and its evidence alone.
"""

from __future__ import annotations

import re
import signal
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from nbddp.contracts.status import Status
from nbddp.doctor.ask import Ask, limit_seconds, where
from nbddp.doctor.examine import check
from nbddp.doctor.verdict import OK, PROBLEM
from nbddp.job.outcome import COLLECTIVE_ERRORS, COLLECTIVE_TIMEOUT, Evidence, JobOutcome

if TYPE_CHECKING:
    from nbddp.plan.job_spec import JobSpec

#: What a rank's error says, and the check that explains it (the first that matches). Not a bare "No space left on
#: device": a full disk says that too.
SIGNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"NCCL (?:error|WARN)|nccl\w*Error|ncclSystemError|ncclInternalError|NCCL communicator", re.I),
     "allreduce"),
    (re.compile(r"Bus error|/dev/shm|shared memory|unable to (?:open|write to) file </torch_", re.I), "shm"),
    (re.compile(r"Too many open files|received \d+ items of ancdata", re.I), "files"),
)
#: A rank that can't reach where the ranks meet (a one-machine run's: loopback; several nodes': the endpoint).
_MEETING = re.compile(r"Address already in use|EADDRINUSE|timed out connecting|Connection refused|"
                      r"failed to (?:connect|bind)", re.I)
#: The after-failure check's limit: the run already ended, and a user waits for its line.
LIMIT = 10.0


def explaining_check(outcome: JobOutcome, e: Evidence, node_rank: int | None) -> str | None:
    """The doctor's check that explains how the run failed, or ``None`` (the run's own code is the usual cause).

    ``node_rank``: this node's, in a run of several (``None``: one machine). Node 0 can't see why another node never
    came, so its failed rendezvous names no check; another node's dials node 0's store. A run nbddp stopped (a time
    limit, a Ctrl-C, ``nbddp kill``) names none: its ranks' errors are the stop's.
    """
    if outcome.status not in (Status.FAILED, Status.TIMEOUT) or e.interrupted_by is not None or e.stop_requested \
            or e.timed_out:
        return None
    several_nodes = node_rank is not None
    if e.rendezvous_failure:
        return None if node_rank == 0 else "endpoint" if several_nodes else "loopback"
    if any(code == -signal.SIGBUS for code in outcome.rank_exit_codes.values()):
        return "shm"
    if not e.errors:
        return None
    first = e.errors[0]
    said = f"{first.type}: {first.message}"
    if COLLECTIVE_TIMEOUT.search(first.message) and first.type in COLLECTIVE_ERRORS:
        return "allreduce"
    for sign, name in SIGNS:
        if sign.search(said):
            return name
    if _MEETING.search(said) and first.type.startswith("Dist"):
        return "endpoint" if several_nodes and node_rank else None if several_nodes else "loopback"
    return None


def diagnosed(outcome: JobOutcome, evidence: Evidence, spec: "JobSpec",
              say: Callable[[str], None] = lambda line: None) -> JobOutcome:
    """``outcome`` with the explaining check's line added to its message (the check run now, said first to
    ``say``), else as it is. A Ctrl-C skips the check; a check that can't run leaves the outcome as judged."""
    launch = spec.launch
    name = explaining_check(outcome, evidence, launch.nodes.rank if launch.nodes is not None else None)
    if name is None:
        return outcome
    ask = Ask(kind=spec.devices.kind, nproc=spec.devices.nproc, gpu_ids=spec.devices.gpu_ids,
              folder=str(spec.run_dir.path.parent), limit=min(LIMIT, limit_seconds()), **where(launch))
    say(f"checking this machine for the cause: nbddp doctor --check {name} (Ctrl-C skips it)")
    try:
        verdict = check(name, ask, env=spec.devices.environment())
    except KeyboardInterrupt:
        return replace(outcome, message=f"{outcome.message}\nnbddp doctor ({name}): skipped (Ctrl-C)")
    except Exception as exc:  # noqa: BLE001 - the run's own ending matters more than its diagnosis
        return replace(outcome, message=f"{outcome.message}\nnbddp doctor ({name}) could not run: {exc}")
    if verdict.state == PROBLEM:
        said = f"nbddp doctor ({name}) found the likely cause: {verdict.line}"
    elif verdict.state == OK:
        beyond = " (the network between the nodes is not checked)" if ask.nodes > 1 and name == "allreduce" else ""
        said = (f"nbddp doctor ({name}) finds nothing wrong here ({verdict.line}){beyond}: the cause is likely in the "
                "run itself")
    else:
        return outcome
    return replace(outcome, message=f"{outcome.message}\n{said}")
