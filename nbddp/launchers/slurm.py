"""Slurm: the ranks run as a Slurm job while the notebook's kernel runs here.

One task per node (``srun --ntasks-per-node=1``) runs the same launcher a single node would:
torchrun with node 0 as the static rendezvous host (torch engine), or the script whose Catalyst
engine spawns the node's ranks. Not one task per rank: torchrun then still owns the ranks of its
node (parent-death signals, per-rank exit codes, its failure report), so a Slurm run reads and
fails exactly like a local one, and the same batch script serves people who submit by hand.

The job is submitted and watched by :mod:`nbddp.launchers.slurm_watch`, which runs as the job's
local "launcher" process: stopping it (Ctrl-C, ``--timeout``, ``nbddp kill``, the kernel's stop
button) cancels the job and waits until it has left the queue. Every rank writes its log into
the run dir, so the run dir must be on a filesystem the nodes share.
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from nbddp._version import __version__
from nbddp.contracts.atomic import read_json
from nbddp.contracts.devices import CPU_PROCESSES, Devices, asked_per_node
from nbddp.engines import spawns_its_own_ranks
from nbddp.contracts.errors import UsageError
from nbddp.launchers.base import Launcher, read_report
from nbddp.engines.torch import MODULE, torchrun_options
from nbddp.plan.options import SlurmRequest
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.rank_env import RankEnv
from nbddp.contracts.interpreter import has_safe_path, module_argv

if TYPE_CHECKING:
    from nbddp.plan.job_spec import JobSpec

#: Final states in which Slurm, not the training, ended the job; what each means for the user.
SCHEDULER_ENDS = {
    "TIMEOUT": "Slurm stopped job {id} at its time limit ({limit}); ask for more with --time.",
    "CANCELLED": "job {id} was cancelled outside nbddp (scancel, or an administrator); every rank was stopped.",
    "NODE_FAIL": "a node of job {id} failed ({nodes}), so Slurm ended the job.",
    "PREEMPTED": "job {id} was preempted by a higher-priority job.",
    "BOOT_FAIL": "the nodes of job {id} failed to boot.",
    "DEADLINE": "job {id} reached its deadline.",
    "OUT_OF_MEMORY": "job {id} ran out of memory; ask for more with --slurm-arg mem=...",
    "UNKNOWN": "job {id} ended, but Slurm no longer knows how (purged, or slurmctld restarted).",
}
FINAL_STATES = {"COMPLETED", "FAILED", "UNKNOWN", *SCHEDULER_ENDS}
#: How long the watcher may take to cancel its job (scancel, then Slurm's KillWait) and see it leave the queue.
CANCEL_SECONDS = 120.0
_NODE_HEADER = "==> node-{} <=="
#: A job's task's node number, expanded by the task's own shell.
NODE_RANK = '"$SLURM_NODEID"'
#: Seconds before its time limit Slurm signals a job that requeues itself (``--signal=B:USR2@...``): time
#: for the ranks to reach their next save. Slurm may signal up to a minute earlier than asked.
REQUEUE_SIGNAL_LEAD = 120
#: The line the batch shell writes at the start of each attempt, into its own log and every node's:
#: a requeued job appends to the same logs, and its report is the last attempt's.
ATTEMPT_MARK = "nbddp: attempt "


class Slurm(Launcher):
    name = "slurm"
    streams_launcher_log = True  # the watcher's "job 12: pending (Resources)" lines
    stop_grace = CANCEL_SECONDS
    exit_settle = 8.0  # the watcher polls Slurm every second; a cancelled job's ranks die first
    job_record = "slurm_job"

    def __init__(self, engine: str, request: SlurmRequest, rdzv_timeout: float,
                 saves_checkpoints: bool = False) -> None:
        """``saves_checkpoints``: the training code calls ``nbddp.save_checkpoint`` (the job requeues itself
        unless ``--no-requeue``).

        Raises:
            UsageError: ``--requeue`` with an engine that doesn't save through nbddp (Catalyst's).
        """
        self.engine, self.request, self.rdzv_timeout = engine, request, rdzv_timeout
        self.saves_checkpoints = saves_checkpoints
        if request.requeue and spawns_its_own_ranks(engine):
            raise UsageError(f"--requeue: the {engine} engine's training doesn't stop and resume through "
                             "nbddp.save_checkpoint/restore, so a requeued job would start over. Drop --requeue.")
        self.requeue = request.requeues(saves_checkpoints) and not spawns_its_own_ranks(engine)
        self.nproc = 1

    @classmethod
    def for_job(cls, spec: JobSpec) -> "Slurm":
        return cls(spec.script.engine, spec.launch.slurm, spec.launch.rdzv_timeout, spec.script.saves_checkpoints)

    def command(self, script: Path, devices: Devices, run_dir: RunDir, *, python: str,
                max_restarts: int = 0) -> list[str]:
        """Write the batch script into the run dir; the command is the watcher that submits it."""
        self.nproc = devices.nproc
        run_dir.slurm.mkdir(exist_ok=True)
        run_dir.sbatch_script.write_text(sbatch_script(
            self.engine, self.request, devices, str(script), python=python, rdzv_timeout=self.rdzv_timeout,
            logs=str(run_dir.logs), job_name=f"nbddp-{script.parent.name}", requeue=run_dir if self.requeue else None),
            encoding="utf-8")
        # No --chdir: sbatch starts the job where the watcher runs, the notebook's folder (local imports).
        return module_argv("nbddp.launchers.slurm_watch", str(run_dir.path), "--max-requeues",
                           str(self.request.max_requeues), *(["--requeue"] if self.requeue else []), python=python)

    def report(self, run_dir: RunDir) -> str:
        """Each node's launcher output of the job's last attempt, headed by its node number (a Catalyst
        node numbers its ranks from 0)."""
        parts = [last_attempt(read_report(run_dir.slurm_batch_log))]
        for node in range(self.request.nodes):
            parts += [_NODE_HEADER.format(node), last_attempt(read_report(run_dir.node_log(node)))]
        return "\n".join(parts)

    def between_attempts(self, run_dir: RunDir, attempt: int) -> bool:
        """The ranks of ``attempt`` stopped at a checkpoint to be requeued, or Slurm requeued the job
        (``scontrol requeue``, preemption) or otherwise stopped running it."""
        if stopped_to_requeue(run_dir, attempt) is not None:
            return True
        job = self.job_info(run_dir) or {}
        return int(job.get("restarts") or 0) > attempt or job.get("state", "RUNNING") != "RUNNING"

    def rank_exit_codes(self, report: str) -> dict[int, int]:
        from nbddp.launchers.catalyst_spawn import CatalystSpawn
        from nbddp.launchers.torchrun import Torchrun

        codes: dict[int, int] = {}
        for node in range(self.request.nodes):
            text = _node_part(report, node)
            if spawns_its_own_ranks(self.engine):
                spawn = CatalystSpawn()
                spawn.first_rank = node * self.nproc
                codes |= spawn.rank_exit_codes(text)
            else:
                codes |= Torchrun().rank_exit_codes(text)
        return codes

    def root_cause(self, report: str) -> int | None:
        from nbddp.launchers.torchrun import Torchrun

        return None if spawns_its_own_ranks(self.engine) else Torchrun().root_cause(report)

    def ended_by_scheduler(self, run_dir: RunDir) -> str | None:
        job = self.job_info(run_dir) or {}
        state = job.get("state")
        if job.get("requeue_bound") is not None:
            return self._bound_reached(run_dir, job)
        if state is None or job.get("cancelled_by_nbddp"):
            return None
        if state != "COMPLETED" and stopped_to_requeue(run_dir, int(job.get("restarts") or 0)) is not None:
            return (f"Slurm: job {job.get('job_id')} stopped at its checkpoint to be requeued, but it wasn't requeued "
                    f"(Slurm said {state}; the batch shell's output is {run_dir.slurm_batch_log}); "
                    f"{_resume_hint(run_dir)}.")
        if state in SCHEDULER_ENDS:
            said = "Slurm: " + SCHEDULER_ENDS[state].format(
                id=job.get("job_id"), limit=job.get("time_limit") or "?", nodes=job.get("nodes") or "?")
            return said + (" " + self._why_not_requeued(run_dir) if state == "TIMEOUT" else "")
        written = [run_dir.slurm_batch_log, *run_dir.written_logs()]
        if state in FINAL_STATES and not any(path.exists() for path in written):
            return (f"Slurm ran job {job.get('job_id')} on {job.get('nodes') or '?'}, but nothing it wrote reached "
                    f"the run dir {run_dir}: the run dir must be on a filesystem the nodes share "
                    "(give --run-dir on one). "
                    f"Slurm said: {state} {job.get('reason') or ''}".rstrip())
        return None

    def _why_not_requeued(self, run_dir: RunDir) -> str:
        if spawns_its_own_ranks(self.engine):
            return (f"It was not requeued: the {self.engine} engine doesn't resume through "
                    "nbddp.save_checkpoint/restore.")
        if not self.requeue:
            if not self.saves_checkpoints:
                return ("It was not requeued: the training saves no checkpoint to resume from. Call "
                        "nbddp.save_checkpoint(...) each epoch and nbddp.restore(...) at the top of the training cell, "
                        "and the job requeues itself before its time limit.")
            return "It was not requeued (--no-requeue)."
        return ("It was not requeued: no rank reached nbddp.save_checkpoint between Slurm's signal (about "
                f"{REQUEUE_SIGNAL_LEAD} s before the limit) and the limit. Save more often, or ask for more time "
                "with --time.")

    def _bound_reached(self, run_dir: RunDir, job: dict) -> str:
        bound = job["requeue_bound"]
        times = f"{bound} time{'' if bound == 1 else 's'}"
        resume = _resume_hint(run_dir)
        if job.get("cancelled_by_nbddp"):
            return (f"Slurm requeued job {job.get('job_id')} more than {times} (--max-requeues {bound}), so nbddp "
                    f"cancelled it; {resume}.")
        return (f"Slurm: job {job.get('job_id')} stopped at its checkpoint to be requeued, but it had been requeued "
                f"{times}, the bound (--max-requeues {bound}); {resume}.")

    def job_info(self, run_dir: RunDir) -> dict | None:
        return read_json(run_dir.slurm_job)


def stopped_to_requeue(run_dir: RunDir, attempt: int) -> dict | None:
    """What ``attempt``'s ranks saved when they all stopped at a checkpoint to be requeued (``{"epoch": 3}``),
    or ``None`` when that attempt didn't stop for a requeue (``slurm/requeue-saved``, written by rank 0)."""
    saved = read_json(run_dir.requeue_saved) or {}
    return (saved.get("saved") or {}) if saved.get("attempt") == attempt else None


def _resume_hint(run_dir: RunDir) -> str:
    return f"its last checkpoint stays in {run_dir} (nbddp.restore({str(run_dir)!r}, model=...) loads it)"


def last_attempt(text: str) -> str:
    """A log of a requeued job: what its last attempt wrote (all of it for a job run once)."""
    start = text.rfind("\n" + ATTEMPT_MARK)
    return text[start + 1:] if start >= 0 else text


def _node_part(report: str, node: int) -> str:
    _, _, rest = report.partition(_NODE_HEADER.format(node))
    return rest.split("==> node-", 1)[0]


def sbatch_script(engine: str, request: SlurmRequest, devices: Devices, script: str, *, python: str,
                  rdzv_timeout: float, logs: str | None = None, job_name: str = "nbddp",
                  requeue: RunDir | None = None) -> str:
    """The batch script: one task per node, each running this node's launcher.

    Every value that comes from the user is quoted with :func:`shlex.quote` (``#SBATCH`` lines are
    read by sbatch, which honours the same quotes), so no name, parameter or path can inject shell.
    ``logs``: where the batch and node outputs go (``None``: beside the submission, for hand use).
    ``requeue``: the run dir of a job that requeues itself (``None``: ``--no-requeue``). Slurm signals
    the batch shell (``B:USR2``: not the steps, whose torchrun would die of it) before the time limit
    and, where the cluster does so, at preemption; the shell tells the ranks through the run dir
    (:mod:`nbddp.rank_side.requeue`), and once they all stopped at a checkpoint it runs
    ``scontrol requeue`` on its own job, unless the job was requeued ``--max-requeues`` times already.
    """
    q = shlex.quote
    safe = " -P" if has_safe_path(python) else ""  # (the job starts in the notebook's folder: not on the path)
    for value in (script, python, logs or ""):
        if any(c in value for c in "\n\r\0"):
            raise UsageError(f"{value!r}: a path with a line break can't go into a batch script; rename it.")
    job_name = re.sub(r"[^\w.-]", "_", job_name)
    out = f"{logs}/" if logs else ""
    directives = [("job-name", job_name), ("nodes", str(request.nodes)), ("ntasks-per-node", "1"),
                  ("output", f"{out}slurm-batch.log" if logs else "slurm-%j.out")]
    if requeue is None:
        directives.append(("no-requeue", None))  # it would start over, and run again over this run's files
    else:  # each attempt appends to the same logs, and resumes from the run's checkpoint
        directives += [("requeue", None), ("open-mode", "append"), ("signal", f"B:USR2@{REQUEUE_SIGNAL_LEAD}")]
    if devices.kind == "cuda":
        directives.append(("gpus-per-node", str(devices.nproc)))
    else:
        directives.append(("cpus-per-task", str(devices.nproc)))
    for key in ("partition", "time", "account"):
        if getattr(request, key) is not None:
            directives.append((key, getattr(request, key)))
    directives += list(request.extra)
    lines = [
        "#!/bin/bash",
        f"# Generated by nbddp {__version__}: {Path(script).name} as a Slurm job, one task per node running "
        + ("torchrun." if not spawns_its_own_ranks(engine) else "Catalyst's DDP engine (it spawns the node's ranks)."),
        f"# Submit by hand: sbatch {'THIS_FILE' if logs else Path(script).with_suffix('.sbatch').name}"
        + ("" if logs else f"   (from the folder of {Path(script).name}; the nodes must share it)"),
        *(f"#SBATCH --{key}" + ("" if value is None else f"={q(value)}") for key, value in directives),
        "set -euo pipefail",
        f"PYTHON={q(python)}",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'port=$("$PYTHON"{safe} -m nbddp.contracts.ports "")  # below the ephemeral range: no connection is handed it '
        'meanwhile',
        'echo "nbddp: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST; rendezvous at $head:$port"',
    ]
    if requeue is not None:
        lines[lines.index(f"PYTHON={q(python)}") + 1:1] = _attempt_lines(requeue, request.max_requeues)
    step = ["srun", "--kill-on-bad-exit=1", f"--output={q(out + 'node-%n.log') if logs else 'node-%n.log'}",
            '${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK}']
    if devices.kind == "cuda":
        step.append(f"--gpus-per-node={devices.nproc}")
    if spawns_its_own_ranks(engine):
        lines.append("export " + RankEnv.shell(nnodes='"$SLURM_NNODES"', master='"$head:$port"',
                                               rdzv_timeout=math.ceil(rdzv_timeout), nproc=devices.nproc,
                                               device=devices.kind))
        inner = f'export {RankEnv.shell(node_rank=NODE_RANK)}; exec "$@"'
        step += ["bash", "-c", q(inner), "node", '"$PYTHON"', *safe.split(), q(script)]
    else:
        # The node rank differs between the job's tasks: the task's own shell expands it (in -c's text).
        options = torchrun_options(devices.nproc, nnodes='"$SLURM_NNODES"', node_rank=NODE_RANK,
                                   endpoint='"$head:$port"', rdzv_timeout=rdzv_timeout, max_restarts=0, monitor=True,
                                   log_dir=logs and f"{logs}/torchrun")
        node_rank = [o for o in options if o.startswith("--node-rank=")]
        inner = " ".join(['exec "$0"', *safe.split(), *MODULE, *node_rank, '"$@"'])
        step += ["bash", "-c", q(inner), '"$PYTHON"',
                 *(o if '"$' in o else q(o) for o in options if o not in node_rank), q(script)]
    if requeue is None:
        lines.append(" ".join(step))
    else:
        step.insert(1, "--open-mode=append")
        lines += [" ".join(step + ["&"]), *_requeue_lines(request.max_requeues)]
    return "\n".join(lines) + "\n"


def _attempt_lines(run_dir: RunDir, max_requeues: int) -> list[str]:
    """Before the step of a job that requeues itself: mark the attempt, and turn Slurm's signal into the
    request every rank reads at its next save."""
    q = shlex.quote
    return [
        'attempt=${SLURM_RESTART_COUNT:-0}',
        f"logs={q(str(run_dir.logs))}",
        f"requeue_request={q(str(run_dir.requeue_request))}",
        f"requeue_saved={q(str(run_dir.requeue_saved))}",
        f'for node in $(seq 0 $((SLURM_NNODES - 1))); do echo "{ATTEMPT_MARK}$((attempt + 1))" >> '
        '"$logs/node-$node.log"; done',
        f'echo "{ATTEMPT_MARK}$((attempt + 1)) of at most {max_requeues + 1}"',
        "export " + RankEnv.shell(requeue=1, requeues='"$attempt"'),
        'rm -f "$requeue_request"',
        # (single-quoted: the trap expands the path when it runs, so no path is ever parsed as shell)
        "trap 'echo \"nbddp: Slurm signalled the job (time limit near, or preemption): every rank stops at its "
        "next nbddp.save_checkpoint\"; echo \"$attempt\" > \"$requeue_request\"' USR2",
    ]


def _requeue_lines(max_requeues: int) -> list[str]:
    """After the step (started in the background, so that the trap runs while it trains): requeue the job
    when every rank stopped at a checkpoint for it, or say why not."""
    return [
        "step=$!",
        "while :; do",  # Slurm's signal interrupts `wait` (status > 128): wait again while the step runs
        '  wait "$step" && code=0 || code=$?',
        '  [ "$code" -gt 128 ] || break',
        '  kill -0 "$step" 2>/dev/null && continue',
        '  wait "$step" && code=0 || { again=$?; [ "$again" -eq 127 ] || code=$again; }',  # it ended meanwhile
        "  break",
        "done",
        "if [ -e \"$requeue_saved\" ] && \"$PYTHON\" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))"
        "[\"attempt\"] != int(sys.argv[2]))' \"$requeue_saved\" \"$attempt\"; then",
        f'  if [ "$attempt" -ge {max_requeues} ]; then',
        f'    echo "nbddp: not requeued: job $SLURM_JOB_ID was requeued $attempt times, the bound '
        f'(--max-requeues {max_requeues})"',
        "    exit 1",
        "  fi",
        '  echo "nbddp: every rank stopped at its checkpoint: requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID" || { echo "nbddp: scontrol requeue failed"; exit 1; }',
        "  sleep 300 & wait $!",  # the requeue ends this shell
        "  exit 1",
        "fi",
        'exit "$code"',
    ]


def slurm_devices(request: SlurmRequest, cpu: bool, nproc: int | None, *, require_commands: bool = True) -> Devices:
    """Per-node devices of a Slurm job: as asked, else every GPU of the partition's nodes, else 2 CPU processes.

    Raises:
        UsageError: Slurm's commands aren't here (not a login node of a cluster), unless
            ``require_commands`` is false (``nbddp export`` only writes the batch script).
    """
    if require_commands:
        require_slurm()
    asked = asked_per_node(request.gpus_per_node, cpu, nproc)
    if asked is not None:
        return asked
    gpus = partition_gpus(request.partition)
    if gpus:
        return Devices("cuda", gpus, note=f"the partition's nodes have {gpus} GPUs each: using all of them "
                                          "(--gpus-per-node G to choose, --cpu for CPU processes).")
    return Devices("cpu", CPU_PROCESSES, note=f"the partition's nodes list no GPUs: {CPU_PROCESSES} CPU processes "
                                              "(gloo) per node (--cpu --nproc P to choose).")


def require_slurm() -> None:
    missing = [tool for tool in ("sbatch", "scontrol", "scancel", "squeue", "sinfo") if shutil.which(tool) is None]
    if missing:
        raise UsageError(f"--slurm: {', '.join(missing)} not found. Run on a machine that submits to the cluster "
                         "(a login node), with Slurm's commands on PATH.")


def partition_gpus(partition: str | None) -> int:
    """GPUs every node of the partition has (the default partition, marked ``*``, when none is named).

    From ``sinfo``'s GRES per node group, e.g. ``gpu:a100:4(S:0-1)``; a group without GPUs counts 0.
    """
    try:
        text = subprocess.run(["sinfo", "-h", "-o", "%P %G"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    counts = []
    for line in text.splitlines():
        name, _, gres = line.strip().partition(" ")
        if (partition is None and not name.endswith("*")) or (partition is not None and name.rstrip("*") != partition):
            continue
        gpus = [item for item in gres.split(",") if item.startswith("gpu")]
        count = gpus[0].split("(")[0].rsplit(":", 1)[-1] if gpus else "0"
        counts.append(int(count) if count.isdigit() else 0)
    return min(counts) if counts else 0
