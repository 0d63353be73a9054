"""The run-dir contract: every file and folder of a run, named in one place.

The launcher side (job, report, stream, registry) and the rank side (runtime) both address a run's
files through :class:`RunDir`, so the two can never disagree about a name. Nothing here imports torch.

::

    RUN_DIR/
      train.py, train.py.map.json   the generated script and its source map
      logs/rank-N.log               each rank's stdout and stderr, interleaved as written
      logs/launcher.log             torchrun's (or the Catalyst parent's, or nbddp's own starter's) output
      logs/launch.json              nbddp's own starter (one machine): each rank's exit code, the first failure
      logs/torchrun/                torchrun's own folder (per-attempt error files)
      store/                        a run on one machine: where torchrun's agent and the ranks meet (FileStores)
      ranks/rank-N.json             a started rank: pid, world size, restart attempt
      ranks/rank-N.done             a rank that finished its training normally
      ranks/memory-N.json           a rank's peak memory so far (bytes, RSS or CUDA's)
      ranks/log-N.json              a rank whose log reached --log-cap: where its kept start ends, what was dropped
      errors/rank-N.json            a rank's uncaught exception, with its traceback
      logs/node-N.log               a Slurm run: node N's torchrun (or Catalyst parent) output
      logs/slurm-batch.log          a Slurm run: the batch script's own output
      nodes.json                    a multi-node run: every node that joined (host, ranks, run dir)
      slurm/job.sbatch, job.json    a Slurm run: the batch script, the job's id, its attempts and how it ended
      slurm/requeue-request         Slurm signalled the job (time limit near, preemption): the attempt it was
      slurm/requeue-saved           every rank stopped at a checkpoint to be requeued: the attempt, what it saved
      ray/job.json                  a Ray run: the Ray job's id, the cluster, its nodes, its state and how it ended
      metrics.jsonl                 rank 0's nbddp.log records
      weights.pt                    the returned variables' trained state (weights only)
      resume.pt                     nbddp.save_checkpoint's training state (--max-restarts)
      resume.dcp/save-*/, latest.json   the same for a sharded model: one folder of shards per save
                                    (torch.distributed.checkpoint), and the name of the last complete one
      stop-requested                `nbddp kill` asked this run to stop
      result.json                   how the run ended, with what, by whom
      tracking.json                 what the run's experiment records get (parameters, nbddp's facts, the trackers
                                    asked for, a batch's group), written before the ranks start
      kernel_records.json           nbddp run, papermill: the records the notebook's kernel had open at the training
                                    cell, for rank 0 to write into
      trackers.json                 the records rank 0 wrote (MLflow's run, TensorBoard's folders, W&B's run), for
                                    nbddp to add the ending
      output.ipynb                  the executed notebook (nbddp run), saved after every cell
      batch.log                     a batch run's own terminal output (nbddp batch)
      detached/request.json         a detached run (--detach): what its supervisor runs (data, never a pickle)
      detached/supervisor.json      its supervisor's pid, then the job's ranks and whether its launcher log is shown
      detached/supervisor.log       the supervisor's transcript: what nbddp run's terminal would have shown
      detached/error.json           a detached run that didn't succeed: its judged error, for the attaching kernel
      debug/rank-N-PID-K/           rank N's K-th debugger session (a breakpoint(), --debug-on-failure), relayed
                                    by the kernel or the terminal (:mod:`nbddp.contracts.debug_channel`)
      debug/first-failure           --debug-on-failure: the first rank to fail opened its post-mortem
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from nbddp.contracts.atomic import read_json
from nbddp.contracts.errors import NbddpError, UsageError
from nbddp.contracts.owned import private_folder


#: The generated script's name in a run dir (and ``nbddp export``'s default name).
SCRIPT_NAME = "train.py"
_RESULT = "result.json"


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def __str__(self) -> str:
        return str(self.path)

    @property
    def script(self) -> Path:
        return self.path / SCRIPT_NAME

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    @property
    def launcher_log(self) -> Path:
        return self.logs / "launcher.log"

    @property
    def launch_report(self) -> Path:
        """What nbddp's own starter saw of the ranks (:mod:`nbddp.launchers.direct_main`)."""
        return self.logs / "launch.json"

    @property
    def torchrun_logs(self) -> Path:
        return self.logs / "torchrun"

    @property
    def store(self) -> Path:
        """Where a run on one machine meets: torchrun's rendezvous and the ranks' group, as files
        (:mod:`nbddp.launchers.private_rendezvous`)."""
        return self.path / "store"

    def node_log(self, node: int) -> Path:
        return self.logs / f"node-{node}.log"

    @property
    def slurm_batch_log(self) -> Path:
        return self.logs / "slurm-batch.log"

    @property
    def nodes(self) -> Path:
        return self.path / "nodes.json"

    @property
    def slurm(self) -> Path:
        return self.path / "slurm"

    @property
    def sbatch_script(self) -> Path:
        return self.slurm / "job.sbatch"

    @property
    def slurm_job(self) -> Path:
        return self.slurm / "job.json"

    @property
    def ray_job(self) -> Path:
        return self.path / "ray" / "job.json"

    @property
    def requeue_request(self) -> Path:
        return self.slurm / "requeue-request"

    @property
    def requeue_saved(self) -> Path:
        return self.slurm / "requeue-saved"

    @property
    def ranks(self) -> Path:
        return self.path / "ranks"

    def rank_info(self, rank: int) -> Path:
        return self.ranks / f"rank-{rank}.json"

    def rank_done(self, rank: int) -> Path:
        return self.ranks / f"rank-{rank}.done"

    @property
    def errors(self) -> Path:
        return self.path / "errors"

    def rank_error(self, rank: int) -> Path:
        return self.errors / f"rank-{rank}.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def weights(self) -> Path:
        return self.path / "weights.pt"

    @property
    def resume(self) -> Path:
        return self.path / "resume.pt"

    @property
    def resume_shards(self) -> Path:
        """The sharded checkpoints' folder: one ``save-*`` folder per save (every rank writes its shard there)
        and :attr:`latest_shards`, the pointer to the last complete one."""
        return self.path / "resume.dcp"

    @property
    def latest_shards(self) -> Path:
        return self.resume_shards / "latest.json"

    def rank_log_cap(self, rank: int) -> Path:
        """``ranks/log-N.json``: a rank log that reached ``--log-cap`` (see :mod:`nbddp.rank_side.log_cap`)."""
        return self.ranks / f"log-{rank}.json"

    def rank_memory(self, rank: int) -> Path:
        """``ranks/memory-N.json``: the rank's peak memory so far (see :mod:`nbddp.rank_side.memory`)."""
        return self.ranks / f"memory-{rank}.json"

    @property
    def stop_mark(self) -> Path:
        return self.path / "stop-requested"

    @property
    def result(self) -> Path:
        return self.path / _RESULT

    @property
    def output(self) -> Path:
        return self.path / "output.ipynb"

    @property
    def tracker_runs(self) -> Path:
        """The experiment records rank 0 wrote (``{"mlflow": {"run_id", "tracking_uri"}, "tensorboard": {"folders"},
        "wandb": {"run_id", …}}``), for the kernel side to add how the run ended (:mod:`nbddp.job.trackers`)."""
        return self.path / "trackers.json"

    @property
    def tracking(self) -> Path:
        """What every experiment record of the run gets (parameters, nbddp's facts, the trackers asked for, a
        batch's group and the run's name in it): the job writes it before the ranks start, rank 0 reads it."""
        return self.path / "tracking.json"

    @property
    def kernel_records(self) -> Path:
        """The records the notebook's kernel had open when it reached the training cell (``nbddp run``,
        papermill): rank 0 waits for it before its first record (:mod:`nbddp.rank_side.trackers`)."""
        return self.path / "kernel_records.json"

    @property
    def batch_log(self) -> Path:
        return self.path / "batch.log"

    @property
    def detached(self) -> Path:
        """``detached/``: a run owned by a supervisor process, not by the kernel or terminal that started it."""
        return self.path / "detached"

    @property
    def detached_request(self) -> Path:
        return self.detached / "request.json"

    @property
    def supervisor(self) -> Path:
        return self.detached / "supervisor.json"

    @property
    def supervisor_log(self) -> Path:
        return self.detached / "supervisor.log"

    @property
    def detached_error(self) -> Path:
        """The judged error of a detached run that didn't succeed, raised by the kernel that attaches."""
        return self.detached / "error.json"

    @property
    def debug(self) -> Path:
        """``debug/``: the ranks' debugger sessions (:class:`~nbddp.contracts.debug_channel.DebugChannel` each)."""
        return self.path / "debug"

    @property
    def debug_first_failure(self) -> Path:
        """``debug/first-failure``: the rank that failed first claimed the post-mortem (``--debug-on-failure``);
        the ranks its end stops open none."""
        return self.debug / "first-failure"

    def holds_a_run(self) -> bool:
        return any(p.exists() for p in (self.result, self.script, self.logs))

    # ------------------------------------------------------------ what the ranks left: each kind of file, found here

    def started_ranks(self) -> list[Path]:
        """``ranks/rank-N.json`` of every rank that started (:meth:`rank_info`)."""
        return sorted(self.ranks.glob("rank-*.json")) if self.ranks.is_dir() else []

    def done_ranks(self) -> frozenset[int]:
        """The ranks that finished their training normally (:meth:`rank_done`)."""
        return frozenset(rank_of(path) for path in self.ranks.glob("rank-*.done"))

    def error_reports(self) -> list[Path]:
        """``errors/rank-N.json`` of every rank that raised (:meth:`rank_error`)."""
        return sorted(self.errors.glob("rank-*.json"))

    def memory_reports(self) -> list[Path]:
        """``ranks/memory-N.json`` of every rank that reported its peak memory (:meth:`rank_memory`)."""
        return sorted(self.ranks.glob("memory-*.json")) if self.ranks.is_dir() else []

    def log_cap_reports(self) -> list[Path]:
        """``ranks/log-N.json`` of every rank whose log reached ``--log-cap`` (:meth:`rank_log_cap`)."""
        return sorted(self.ranks.glob("log-*.json")) if self.ranks.is_dir() else []

    def written_logs(self) -> list[Path]:
        """The ranks' and the nodes' logs there are (:meth:`rank_log`, :meth:`node_log`)."""
        return [*self.logs.glob("node-*.log"), *self.logs.glob("rank-*.log")]

    def restarts(self) -> int:
        """torchrun's restart count of the latest attempt (from the ranks' own reports)."""
        reports = [read_json(info) for info in self.started_ranks()]
        return max([0, *(int(report.get("attempt", 0)) for report in reports if isinstance(report, dict))])

    def dropped_output(self) -> dict[int, int]:
        """``{rank: bytes}`` each rank's log dropped beyond ``--log-cap`` (only ranks that reached it)."""
        dropped = {}
        for report in self.log_cap_reports():
            found = read_json(report)
            if isinstance(found, dict) and isinstance(found.get("dropped"), int):
                dropped[rank_of(report)] = found["dropped"]
        return dict(sorted(dropped.items()))

    def roster(self) -> list[dict[str, Any]]:
        """The nodes that joined a multi-node run (:attr:`nodes`), empty on one machine."""
        found = read_json(self.nodes)
        return list(found) if isinstance(found, list) else []

    @classmethod
    def ended_under(cls, folder: Path) -> list["RunDir"]:
        """The run dirs directly under ``folder`` (a batch's ``--out``) that hold a ``result.json``."""
        return [cls(path.parent) for path in sorted(Path(folder).glob(f"*/{_RESULT}"))]


def create_run_dir(notebook: Path, run_dir: Path | None = None, say: Callable[[str], Any] | None = None) -> RunDir:
    """``runs/<stem>-<timestamp>`` beside the notebook, unique even within one second, private; or
    ``run_dir`` (``--run-dir``), which must not hold a run already (runs are never overwritten). ``say``: told in one
    line when an existing folder others could read was made private (:func:`~nbddp.contracts.owned.private_folder`).

    Raises:
        NotYours: ``--run-dir``, or the ``runs`` folder, belongs to another user or others can write to it
            (:mod:`nbddp.contracts.owned`). UsageError: ``--run-dir`` holds a run.
    """
    if run_dir is not None:
        run_dir = Path(run_dir)
        if RunDir(run_dir).holds_a_run():
            raise UsageError(f"--run-dir {run_dir} already holds a run. "
                             "Choose a new folder (runs are never overwritten).")
        return RunDir(private_folder(run_dir, "--run-dir", parents=True, say=say).resolve())
    parent = private_folder(notebook.resolve().parent / "runs", "the runs folder", say=say)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1, 10_000):
        candidate = parent / (f"{notebook.stem}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            candidate.mkdir(mode=0o700)  # atomic: two runs in the same second get different dirs
            return RunDir(candidate)
        except FileExistsError:
            continue
    raise NbddpError(f"could not create a run dir in {parent}.")


def rank_of(path: Path) -> int:
    """``rank-3.json`` / ``rank-3.done`` / ``rank-3.log`` → 3."""
    return int(path.name.split(".")[0].split("-")[1])
