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

from nbddp.contracts.devices import Devices
from nbddp.contracts.interpreter import module_argv
from nbddp.contracts.process_groups import signal_group
from nbddp.doctor.allreduce import IMPORT_SECONDS, ranks_for, stuck
from nbddp.doctor.ask import CHECKS, Ask
from nbddp.doctor.verdict import OK, PROBLEM, SKIPPED, Verdict, ok, problem, skipped

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
    """Run the checks ``names`` (all that apply by default) at once; each ends within its limit. A Ctrl-C stops
    every check's processes at once (they lead sessions of their own, out of the terminal's reach) and propagates."""
    started = time.monotonic()
    names = chosen(ask, names)
    checkup = Checkup(ask, env)
    pool = ThreadPoolExecutor(max_workers=len(names) or 1)
    try:
        verdicts = list(pool.map(checkup.check, names))
    except BaseException:
        checkup.stop()
        raise
    finally:
        pool.shutdown(wait=True)
    return Report(ask, tuple(verdicts), time.monotonic() - started)


def check(name: str, ask: Ask, env: dict[str, str] | None = None) -> Verdict:
    """One check's verdict (:meth:`Checkup.check`), its processes stopped if this is interrupted."""
    checkup = Checkup(ask, env)
    try:
        return checkup.check(name)
    except BaseException:
        checkup.stop()
        raise


class Checkup:
    """One examination: the checks' subprocesses it runs now, stopped together when it is (nothing started after)."""

    def __init__(self, ask: Ask, env: dict[str, str] | None = None) -> None:
        self.ask, self.env = ask, dict(env or {})
        self.running: set[int] = set()
        self.stopped = False
        self.lock = threading.Lock()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            for pgid in self.running:
                signal_group(pgid, signal.SIGKILL)

    def check(self, name: str) -> Verdict:
        """One check's verdict, timed (a local check on a cluster's run: skipped, said why)."""
        started, ask = time.monotonic(), self.ask
        if name in LOCAL and ask.on_a_cluster:
            return skipped(name, f"the ranks run on {ask.on_a_cluster}'s nodes: run nbddp doctor on one of them, "
                                 "with the run's device options")
        if name == "gpus" and ask.devices_unknown:
            return problem(name, ask.devices_unknown, "GPU runs hang or fail as they start", "nvidia-smi says whether "
                           "the driver answers; a GPU fallen off the bus needs a reset (nvidia-smi -r) or a reboot")
        if name == "allreduce":
            chosen_gpus = Devices(ask.kind, ask.nproc, gpu_ids=ask.gpu_ids).environment()  # (--gpus free's)
            verdict = transports(ask, lambda extra: self.subprocess_verdict(name, {**chosen_gpus, **extra}))
        else:
            verdict = self.subprocess_verdict(name)
        return replace(verdict, seconds=round(time.monotonic() - started, 2))

    def subprocess_verdict(self, name: str, extra: dict[str, str] | None = None) -> Verdict:
        """``python -m nbddp.doctor.checks NAME``'s verdict, or the problem of its never answering in time (the
        all-reduce's limit counts from its ranks' imports of torch: their time is added)."""
        limit = limit_of(name, self.ask)
        with self.lock:
            if self.stopped:
                return skipped(name, "the doctor was stopped")
            process = subprocess.Popen(module_argv("nbddp.doctor.checks", name),
                                       env={**os.environ, **self.env, **(extra or {})}, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)
            self.running.add(process.pid)
        try:
            out, err = process.communicate(self.ask.to_json(), timeout=limit)
        except subprocess.TimeoutExpired:
            signal_group(process.pid, signal.SIGKILL)
            process.communicate()
            return problem(name, f"the check did not answer in {limit:g} s", _HANGS.get(name, "a run may hang the "
                           "same way"), "look at what it touches by hand; NBDDP_DOCTOR_TIMEOUT gives it longer")
        finally:
            with self.lock:
                signal_group(process.pid, signal.SIGKILL)  # (what it started and left: nothing outlives the check)
                self.running.discard(process.pid)
        try:
            return Verdict(**json.loads(out.strip().splitlines()[-1]))
        except (ValueError, IndexError, TypeError):
            said = (err.strip().splitlines() or [f"exit {process.returncode}"])[-1]
            return problem(name, f"the check itself failed ({said})", "what it examines is unknown",
                           "report it with this line (nbddp's issue tracker)")


def limit_of(name: str, ask: Ask) -> float:
    """The seconds a check's process may take: its limit, the all-reduce's ranks' imports of torch beside, a
    margin to say what it found."""
    return ask.limit + (max(ask.limit, IMPORT_SECONDS) if name == "allreduce" else 0) + MARGIN


_HANGS = {"versions": "importing torch or asking the driver hangs: so will every rank",
          "gpus": "the driver doesn't answer NVML: GPU runs will hang or fail",
          "endpoint": "the nodes or the cluster can't be reached"}


def transports(ask: Ask, attempt: Callable[[dict[str, str]], Verdict]) -> Verdict:
    """The all-reduce's verdict from its attempts: one, and under NCCL when it hangs, one per transport turned off
    (:data:`TRANSPORTS`) until one passes, naming the transport that hangs and the variable that avoids it."""
    ranks = ranks_for(ask.kind, ask.nproc)
    what = f"a {ranks}-rank all-reduce ({ask.backend}" + (f", {ranks} of the run's {ask.nproc} ranks)"
                                                         if ranks < ask.nproc else ")")
    first = attempt({})
    found = {"attempts": [first.found]}
    if first.state == "ok":
        return ok("allreduce", f"{what} took {first.found['seconds']:g} s", **found)
    if first.state == "failed":
        return problem("allreduce", f"{what} failed: {first.found.get('error')}", "every run fails at its first "
                       "collective", "NCCL_DEBUG=INFO names NCCL's cause" if ask.backend == "nccl" else
                       "that error is torch.distributed's own on this machine", **found)
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
    failed = [step.get("error") for step in found["attempts"][1:] if step.get("state") == "failed"]
    said = f"; without them it failed: {failed[-1]}" if failed else ""
    return problem("allreduce", f"{what} hangs with every transport tried (P2P, shared memory, both off){said}",
                   "runs hang at their first collective",
                   "run with NCCL_DEBUG=INFO to see where it stops; check the driver and nvidia-smi topo -m", **found)


def _stages(attempt: Verdict) -> dict[int, str]:
    return {int(rank): stage for rank, stage in attempt.found.get("stages", {}).items()}


def text(report: Report) -> list[str]:
    """The report as the terminal and a notebook show it: a line per check, then the summary."""
    lines = [f"nbddp doctor: {report.ask.describe()}"]
    width = max((len(v.check) for v in report.verdicts), default=0)
    for verdict in report.verdicts:
        mark = {PROBLEM: "FAIL", SKIPPED: "skip"}.get(verdict.state, "ok")
        lines.append(f"  {mark:<4}  {verdict.check:<{width}}  {verdict.line}")
    failed, passed = len(report.problems), sum(v.state == OK for v in report.verdicts)
    skipped_ = len(report.verdicts) - failed - passed
    aside = f" ({skipped_} skipped)" if skipped_ else ""
    if failed:
        lines.append(f"{failed} of {failed + passed} checks failed{aside} in {report.seconds:.1f} s")
    elif passed:
        lines.append(f"{'all ' if passed > 1 else ''}{passed} check{'s' * (passed > 1)} passed{aside} in "
                     f"{report.seconds:.1f} s")
    else:
        lines.append(f"no check ran{aside}")
    return lines
