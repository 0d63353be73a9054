"""The checks at once, each in a subprocess with its own time limit: the doctor never hangs and leaves nothing.

Each check's subprocess (``python -m nbddp.doctor.checks NAME``) leads a session of its own, and what it starts (the
all-reduce's ranks) is in it: a check past its limit is killed with everything it started, and said as the problem
it is (a hang is the finding). The all-reduce is judged here from its attempts (:func:`transports`): a hang under
NCCL is tried again with peer-to-peer off, then shared memory off, to name the transport that hangs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from nbddp.contracts.interpreter import module_argv
from nbddp.contracts.process_groups import signal_group
from nbddp.doctor.allreduce import IMPORT_SECONDS, stuck
from nbddp.doctor.ask import CHECKS, Ask
from nbddp.doctor.verdict import PROBLEM, SKIPPED, Verdict, ok, problem, skipped

#: Checks about this machine's ranks: on a cluster, its nodes' own (the doctor run there says).
LOCAL = ("gpus", "allreduce", "shm", "memlock", "files", "loopback")
#: Seconds a check's subprocess gets beyond its limit to say what it found (its own waits end at the limit).
MARGIN = 5.0
#: NCCL's transports, turned off one by one when its all-reduce hangs: what each variable turns off.
TRANSPORTS = (({"NCCL_P2P_DISABLE": "1"}, "peer-to-peer (P2P) between the GPUs"),
              ({"NCCL_SHM_DISABLE": "1"}, "its shared-memory transport"),
              ({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, "both P2P and shared memory"))


@dataclass(frozen=True)
class Report:
    ask: Ask
    verdicts: tuple[Verdict, ...]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)

    @property
    def problems(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.state == PROBLEM]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.passed, "seconds": round(self.seconds, 2), "run": self.ask.describe(),
                "checks": [v.to_dict() for v in self.verdicts]}


def chosen(ask: Ask, names: Sequence[str] = ()) -> list[str]:
    """The checks to run for ``ask``: ``names`` (all by default), the endpoint only where there is one."""
    wanted = list(names) or [name for name in CHECKS
                             if name != "endpoint" or ask.nodes > 1 or ask.on_a_cluster]
    return [name for name in CHECKS if name in wanted]


def examine(ask: Ask, names: Sequence[str] = (), env: dict[str, str] | None = None) -> Report:
    """Run the checks ``names`` (all that apply by default) at once; each ends within its limit."""
    started = time.monotonic()
    names = chosen(ask, names)
    pool = ThreadPoolExecutor(max_workers=len(names) or 1)
    try:
        verdicts = list(pool.map(lambda name: check(name, ask, env), names))
    except BaseException:  # (a Ctrl-C: the checks' processes lead sessions of their own, out of the terminal's reach)
        _STOPPING.set()
        for pgid in list(_RUNNING):
            signal_group(pgid, signal.SIGKILL)
        raise
    finally:
        pool.shutdown(wait=True)
    return Report(ask, tuple(verdicts), time.monotonic() - started)


#: The process groups of the checks running now (each check's subprocess leads one).
_RUNNING: set[int] = set()
#: Set once the doctor is stopped: no check starts another process.
_STOPPING = threading.Event()


def check(name: str, ask: Ask, env: dict[str, str] | None = None) -> Verdict:
    """One check's verdict, timed (a local check on a cluster's run: skipped, said why)."""
    started = time.monotonic()
    if name in LOCAL and ask.on_a_cluster:
        return skipped(name, f"the ranks run on {ask.on_a_cluster}'s nodes: run nbddp doctor there (e.g. in a job)")
    if name == "allreduce":
        verdict = transports(ask, lambda extra: subprocess_verdict(name, ask, {**(env or {}), **extra}))
    else:
        verdict = subprocess_verdict(name, ask, env)
    return replace(verdict, seconds=round(time.monotonic() - started, 2))


def subprocess_verdict(name: str, ask: Ask, env: dict[str, str] | None = None) -> Verdict:
    """``python -m nbddp.doctor.checks NAME``'s verdict, or the problem of its never answering in time (the
    all-reduce's limit counts from its ranks' imports of torch: their time is added)."""
    limit = ask.limit + (max(ask.limit, IMPORT_SECONDS) if name == "allreduce" else 0) + MARGIN
    if _STOPPING.is_set():
        return skipped(name, "the doctor was stopped")
    process = subprocess.Popen(module_argv("nbddp.doctor.checks", name), env={**os.environ, **(env or {})},
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    _RUNNING.add(process.pid)
    try:
        out, err = process.communicate(ask.to_json(), timeout=limit)
    except subprocess.TimeoutExpired:
        signal_group(process.pid, signal.SIGKILL)
        process.communicate()
        return problem(name, f"the check did not answer in {limit:g} s", _HANGS.get(name, "a run may hang the same "
                       "way"), "look at what it touches by hand; NBDDP_DOCTOR_TIMEOUT gives it longer")
    finally:
        signal_group(process.pid, signal.SIGKILL)  # (what it started and left: nothing outlives the doctor's check)
        _RUNNING.discard(process.pid)
    try:
        return Verdict(**json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError):
        said = (err.strip().splitlines() or [f"exit {process.returncode}"])[-1]
        return problem(name, f"the check itself failed ({said})", "what it examines is unknown",
                       "report it with this line (nbddp's issue tracker)")


_HANGS = {"versions": "importing torch or asking the driver hangs: so will every rank",
          "gpus": "the driver doesn't answer NVML: GPU runs will hang or fail",
          "endpoint": "the nodes or the cluster can't be reached"}


def transports(ask: Ask, attempt: Callable[[dict[str, str]], Verdict]) -> Verdict:
    """The all-reduce's verdict from its attempts: one, and under NCCL when it hangs, one per transport turned off
    (:data:`TRANSPORTS`) until one passes, naming the transport that hangs and the variable that avoids it."""
    what = f"a {ask.nproc}-rank all-reduce ({ask.backend})"
    first = attempt({})
    found = {"attempts": [first.found]}
    if first.state == "ok":
        return ok("allreduce", f"{what} took {first.found['seconds']:g} s", **found)
    if first.state == "failed":
        return problem("allreduce", f"{what} failed: {first.found.get('error')}", "every run fails at its first "
                       "collective", _fix_for(ask), **found)
    if first.state != "hung":  # (the check's own subprocess never answered, or failed: its verdict says)
        return replace(first, check="allreduce")
    if ask.backend != "nccl":
        return problem("allreduce", f"{what} hung for {ask.limit:g} s: {stuck(_stages(first))}",
                       "runs hang at their first collective until --collective-timeout",
                       "look for a process that stops a rank (a debugger, a sandbox) or a firewall on the loopback "
                       "interface", **found)
    for variables, transport in TRANSPORTS:
        again = attempt(variables)
        found["attempts"].append(again.found | {"env": variables})
        if again.state == "ok":
            assigned = " ".join(f"{k}={v}" for k, v in variables.items())
            return problem("allreduce", f"{what} hangs with {transport} and works without it", "runs hang at "
                           "their first collective", f"export {assigned} before starting Jupyter or nbddp (or set it "
                           "in the notebook's kernel spec)", **found)
    return problem("allreduce", f"{what} hangs with every transport tried (P2P, shared memory, both off)",
                   "runs hang at their first collective",
                   "run with NCCL_DEBUG=INFO to see where it stops; check the driver and nvidia-smi topo -m", **found)


def _stages(attempt: Verdict) -> dict[int, str]:
    return {int(rank): stage for rank, stage in attempt.found.get("stages", {}).items()}


def _fix_for(ask: Ask) -> str:
    return ("NCCL_DEBUG=INFO names the cause; see the line above" if ask.backend == "nccl"
            else "check the line above: a rank that can't start torch.distributed")


def text(report: Report) -> list[str]:
    """The report as the terminal and a notebook show it: a line per check, then the summary."""
    lines = [f"nbddp doctor: {report.ask.describe()}"]
    width = max((len(v.check) for v in report.verdicts), default=0)
    for verdict in report.verdicts:
        mark = {PROBLEM: "FAIL", SKIPPED: "skip"}.get(verdict.state, "ok")
        lines.append(f"  {mark:<4}  {verdict.check:<{width}}  {verdict.line}")
    failed = len(report.problems)
    lines.append(f"{'all' if not failed else f'{failed} of'} {len(report.verdicts)} checks "
                 f"{'passed' if not failed else 'failed'} in {report.seconds:.1f} s")
    return lines
