"""``python -m nbddp.launchers.slurm_watch RUN_DIR [--max-requeues N] [--requeue]``: submit a run's Slurm job and
watch it to the end.

This process stands in for the job on the machine that submitted it, so the rest of nbddp owns
it like any local launcher: it prints the job id and the queue state (with Slurm's reason while
pending), exits with the job's exit status, and records the job in ``RUN_DIR/slurm/job.json``
(its state as it changes, each attempt, how it ended). A requeued job (it requeued itself at a
checkpoint, or Slurm did: ``scontrol requeue``, preemption) is the same run: the watcher says so
and follows the next attempt; beyond ``--max-requeues`` requeues it cancels the job.
SIGTERM, SIGINT or SIGHUP (Ctrl-C, ``--timeout``, ``nbddp kill``, the kernel's stop button, or the
parent dying) cancel the job with ``scancel`` and wait until it has left the queue before exiting
``128 + signal``: nothing is left running on the cluster, and a cancelled job is never requeued.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from nbddp.contracts.atomic import write_json
from nbddp.launchers.slurm import FINAL_STATES, stopped_to_requeue
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.status import signal_exit_code

POLL_SECONDS = 1.0
#: A job neither ``scontrol`` nor ``squeue`` knows for this long has ended without us seeing how.
FORGOTTEN_SECONDS = 30.0
_FIELDS = {key: re.compile(rf"\b{key}=(.*?)(?= \w+=|$)") for key in
           ("JobState", "Reason", "ExitCode", "NodeList", "TimeLimit", "RunTime", "Restarts")}
#: A job that requeues itself may show PREEMPTED for a moment before Slurm requeues it.
PREEMPTED_SETTLE_SECONDS = 15.0
_LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "vfat", "ramfs"}


class Watcher:
    def __init__(self, run_dir: RunDir, max_requeues: int = 0, requeues_itself: bool = False) -> None:
        self.run_dir = run_dir
        self.max_requeues, self.requeues_itself = max_requeues, requeues_itself
        self.job_id: str | None = None
        self.stop_signal: int | None = None
        self.shown = ""
        self.restarts = 0
        self.attempts: list[dict] = []

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = self.stop_signal or signum

    def run(self) -> int:
        say(shared_filesystem_warning(self.run_dir.path))
        self.job_id = submit(self.run_dir)
        self.record(state="PENDING")
        say(f"slurm job {self.job_id}: submitted ({self.run_dir.sbatch_script})")
        info: dict[str, str] = {}
        unknown_since: float | None = None
        preempted_since: float | None = None
        while self.stop_signal is None:
            found = query(self.job_id)
            if found is None and not in_queue(self.job_id):
                unknown_since = unknown_since or time.monotonic()
                if time.monotonic() - unknown_since > FORGOTTEN_SECONDS:  # purged, or slurmctld lost it
                    return self.finish({**info, "JobState": "UNKNOWN", "Reason": "Slurm no longer knows the job"})
            else:
                unknown_since = None
            info = found or info
            if self.requeued(info) and self.restarts > self.max_requeues:
                say(f"slurm job {self.job_id}: requeued {self.restarts} times, more than --max-requeues "
                    f"{self.max_requeues}: cancelling it")
                return self.cancel(info, requeue_bound=self.max_requeues)
            self.show(info)
            state = info.get("JobState")
            if state != "PREEMPTED":
                preempted_since = None
            elif self.requeues_itself:
                preempted_since = preempted_since or time.monotonic()
                if time.monotonic() - preempted_since < PREEMPTED_SETTLE_SECONDS:
                    self.sleep(POLL_SECONDS)
                    continue
            if state in FINAL_STATES:
                return self.finish(info)
            self.sleep(POLL_SECONDS)
        return self.cancel(info)

    def requeued(self, info: dict[str, str]) -> bool:
        """Follow the job into its next attempt when Slurm's restart count grew; True when it did."""
        restarts = int(info["Restarts"]) if info.get("Restarts", "").isdigit() else self.restarts
        if restarts <= self.restarts:
            return False
        saved = stopped_to_requeue(self.run_dir, self.restarts)
        if saved is not None:
            at = ", ".join(f"{k}={v}" for k, v in saved.items())
            why = "after Slurm's signal: every rank saved at its checkpoint" + (f" ({at})" if at else "")
        else:
            why = "by Slurm (scontrol requeue, preemption or a node's failure); it resumes from its last checkpoint"
        self.end_attempt(f"requeued {why}")
        self.restarts = restarts
        self.shown = ""
        say(f"slurm job {self.job_id}: requeued {why} → attempt {restarts + 1}")
        return True

    def end_attempt(self, how: str) -> None:
        if self.attempts and "ended" not in self.attempts[-1]:
            self.attempts[-1] |= {"ended": time.time(), "how": how}

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self.stop_signal is None and time.monotonic() < end:
            time.sleep(0.05)

    def show(self, info: dict[str, str]) -> None:
        state, reason = info.get("JobState", ""), info.get("Reason", "None")
        attempt = f" (attempt {self.restarts + 1})" if self.restarts else ""
        if state == "PENDING":
            line = "pending" + (f" ({reason})" if reason not in ("None", "") else "")
        elif state == "RUNNING":
            line = f"running on {info.get('NodeList')}{attempt}"
            if not self.attempts or "ended" in self.attempts[-1]:
                self.attempts.append({"attempt": self.restarts + 1, "nodes": info.get("NodeList"),
                                      "started": time.time()})
        else:
            return
        if line != self.shown:
            self.shown = line
            say(f"slurm job {self.job_id}: {line}")
            self.record(state=state, reason=info.get("Reason"), nodes=info.get("NodeList"))

    def finish(self, info: dict[str, str]) -> int:
        state = info["JobState"]
        code, sig = (int(x) if x.isdigit() else 0 for x in (info.get("ExitCode", "0:0").split(":") + ["0"])[:2])
        exit_code = 0 if state == "COMPLETED" and code == 0 else (code or (signal_exit_code(sig) if sig else 1))
        self.end_attempt(state)
        stopped = state != "COMPLETED" and stopped_to_requeue(self.run_dir, self.restarts) is not None
        bound = self.max_requeues if stopped and self.restarts >= self.max_requeues else None
        self.record(state=state, reason=info.get("Reason"), exit_code=exit_code, nodes=info.get("NodeList"),
                    time_limit=info.get("TimeLimit"), run_time=info.get("RunTime"), requeue_bound=bound)
        say(f"slurm job {self.job_id}: {state}"
            + (f" ({info.get('Reason')})" if info.get("Reason") not in (None, "None") else "")
            + f", exit {exit_code}")
        return exit_code

    def cancel(self, info: dict[str, str], requeue_bound: int | None = None) -> int:
        """scancel, then wait until the job has left the queue (its processes are gone with it).
        ``requeue_bound``: cancelled for having been requeued more often than that, not by a signal."""
        signum = self.stop_signal or signal.SIGTERM
        if self.job_id is None:
            return signal_exit_code(signum)
        say(f"slurm job {self.job_id}: cancelling (scancel), waiting for it to leave the queue")
        while True:  # scancel again each round: a slurmctld too busy to answer must not leave the job behind
            _slurm(["scancel", self.job_id])
            info = query(self.job_id) or {"JobState": "CANCELLED"}
            if info.get("JobState") in FINAL_STATES and not in_queue(self.job_id):
                break
            time.sleep(0.5)
        exit_code = 1 if requeue_bound is not None else signal_exit_code(signum)
        self.end_attempt("cancelled by nbddp")
        self.record(state=info["JobState"], reason=info.get("Reason"), exit_code=exit_code,
                    nodes=info.get("NodeList"), cancelled_by_nbddp=True, requeue_bound=requeue_bound)
        say(f"slurm job {self.job_id}: cancelled; it has left the queue")
        return exit_code

    def record(self, **fields: Any) -> None:
        """``job.json``: the job as it is now (rewritten as it changes), with every attempt so far."""
        known = {k: v for k, v in fields.items() if v is not None}
        write_json(self.run_dir.slurm_job, {"job_id": self.job_id, **known, "restarts": self.restarts,
                                            "attempts": self.attempts}, indent=1)


def _slurm(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess | None:
    """A Slurm command in a session of its own (a signal to the watcher's group must not cut it short);
    ``None`` when it didn't answer in time."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return None


def submit(run_dir: RunDir) -> str:
    done = _slurm(["sbatch", "--parsable", str(run_dir.sbatch_script)], timeout=120)
    if done is None:
        say("slurm: sbatch didn't answer within 120 s; if it submitted the job, cancel it with scancel --name")
        raise SystemExit(2)
    if done.returncode != 0:
        say(f"slurm: sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
        raise SystemExit(2)
    return done.stdout.strip().split(";")[0]


def query(job_id: str) -> dict[str, str] | None:
    """The job's fields from ``scontrol show job -o`` (``None`` when Slurm no longer knows it)."""
    done = _slurm(["scontrol", "show", "job", "-o", job_id])
    if done is None or done.returncode != 0 or "JobState=" not in done.stdout:
        return None
    line = done.stdout.strip().splitlines()[0]
    return {key: m.group(1) for key, pattern in _FIELDS.items() if (m := pattern.search(line))}


def in_queue(job_id: str) -> bool:
    done = _slurm(["squeue", "-h", "-j", job_id, "-o", "%i"])
    return done is None or (done.returncode == 0 and bool(done.stdout.strip()))  # no answer: assume still there


def shared_filesystem_warning(path: Path) -> str | None:
    """A warning when the run dir is on this machine's own disk while the cluster has other nodes."""
    fstype = filesystem_type(path)
    if fstype not in _LOCAL_FILESYSTEMS:
        return None
    done = _slurm(["sinfo", "-h", "-N", "-o", "%N"])
    names = done.stdout.split() if done is not None else []
    if not names or set(names) <= {socket.gethostname(), socket.getfqdn(), "localhost"}:
        return None
    return (f"slurm: warning: the run dir {path} is on this machine's own disk ({fstype}); ranks on other nodes "
            "can't write their logs and weights there. Give --run-dir on a filesystem the nodes share.")


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path``, from ``/proc/mounts`` (longest mount point wins)."""
    path, best, fstype = Path(path).resolve(), -1, ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(fields[1].replace("\\040", " "))
        if (path == point or point in path.parents) and len(str(point)) > best:
            best, fstype = len(str(point)), fields[2]
    return fstype


def say(line: str | None) -> None:
    if line:
        print(line, flush=True)


def main(argv: list[str]) -> int:
    max_requeues = int(argv[argv.index("--max-requeues") + 1]) if "--max-requeues" in argv else 0
    watcher = Watcher(RunDir(Path(argv[0])), max_requeues, requeues_itself="--requeue" in argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, watcher.on_signal)
    return watcher.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
