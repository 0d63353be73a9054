"""What happened in a run, told in the notebook's terms: rank errors and ``result.json``.

Each rank that raised wrote ``errors/rank-N.json`` (see :mod:`nbddp.rank_side.torch_engine`);
the root cause is the earliest one, as in torchrun. Its frames in the
generated script are translated through the source map to ``cell N, line L``.
Ranks killed by a signal leave no error file; their exit codes are read from
the launcher's own failure report (torchrun's, or ``mp.spawn``'s).
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbddp._version import __version__
from nbddp.contracts.atomic import read_json, write_json
from nbddp.contracts.metrics import last_metrics
from nbddp.contracts.rank_memory import read_peaks
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.status import Status
from nbddp.contracts.sourcemap import SourceMap
from nbddp.job import trackers

if TYPE_CHECKING:
    from nbddp.plan.job_spec import JobSpec
    from nbddp.launchers.base import Launcher


@dataclass(frozen=True)
class RankError:
    rank: int
    type: str
    message: str
    cell: int | None
    line: int | None
    location: str | None
    """``nb.ipynb, cell 3, line 5`` or ``In [5], line 2``; ``None`` outside the notebook's code."""
    source_line: str
    traceback: str
    time: float
    attempt: int = 0
    """torchrun's restart count when it was raised (``--max-restarts``)."""

    def headline(self, notebook: str) -> str:
        where = self.location or f"{notebook} (outside the notebook's cells)"
        text = f"rank {self.rank} raised {self.type}: {self.message}\n  at {where}"
        if self.source_line:
            text += f"\n      {self.source_line.strip()}"
        return text


def rank_errors(run_dir: RunDir, source_map: SourceMap) -> list[RankError]:
    """Every rank's recorded exception, earliest first."""
    errors = []
    for path in run_dir.error_reports():
        data = read_json(path)
        if not isinstance(data, dict):
            continue
        cell = line = location = None
        source_line = ""
        for frame in reversed(data.get("frames", [])):  # innermost frame that is notebook code
            if Path(frame["file"]).name == Path(source_map.script).name:
                where = source_map.lookup(frame["line"])
                if where:
                    cell, line, _ = where
                    location = source_map.where(frame["line"])
                    source_line = frame.get("text", "")
                    break
        errors.append(RankError(
            rank=data["rank"], type=data["type"], message=data["message"], cell=cell, line=line,
            location=location, source_line=source_line, attempt=int(data.get("attempt", 0)),
            traceback=source_map.translate_traceback(data.get("traceback", "")),
            time=data.get("time", 0.0),
        ))
    return sorted(errors, key=lambda e: e.time)


def describe_exit(code: int) -> str:
    """``-9`` → ``killed by SIGKILL (out of memory?)``; positive codes as they are."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (often the kernel's out-of-memory killer)" if -code == signal.SIGKILL else ""
        hint = " (a crash in native code)" if -code == signal.SIGSEGV else hint
        return f"killed by {name}{hint}"
    return f"exit code {code}"


@dataclass
class RunRecord:
    """``result.json``: everything needed to understand a run afterwards."""

    status: str
    exit_code: int
    notebook: str
    engine: str
    devices: dict[str, Any]
    world_size: int
    parameters: dict[str, Any]
    """Every parameter value the run used: the parameters cell's defaults with the overrides applied
    (a default that isn't a literal is ``{"expression": "..."}``)."""
    started_at: float
    ended_at: float
    wall_time_s: float
    rank_exit_codes: dict[str, int] = field(default_factory=dict)
    final_metrics: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0
    checkpoint: str | None = None
    error: str | None = None
    """Why the run didn't succeed, as the run's error says it (several lines)."""
    failure: dict[str, Any] | None = None
    """What was judged of the exception that ended the run, when anything was (:data:`nbddp.contracts.errors.JUDGED`:
    ``rank`` (``None``: a kernel cell), ``exc_type``, ``exc_message``, notebook ``cell`` and ``line``)."""
    script: str = ""
    """The generated script's path."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """The parameters given on the command line (``-p``) or by the batch, which win over the defaults."""
    command: str = ""
    """How the run was started: the exact ``nbddp ...`` command, or the ``%%ddp_train`` line."""
    nodes: list[dict[str, Any]] = field(default_factory=list)
    """A multi-node run: every node that joined (node rank, host, its ranks, its run dir)."""
    peak_memory: dict[str, int] = field(default_factory=dict)
    """Each rank's peak memory in bytes: CUDA's peak allocated on GPU ranks, else the process's peak RSS."""
    dropped_output: dict[str, int] = field(default_factory=dict)
    """Bytes of each rank's output its log didn't keep beyond ``--log-cap`` (only ranks that reached it)."""
    slurm_job: dict[str, Any] | None = None
    """A Slurm run: the job's id, final state and reason, and its nodes."""
    ray_job: dict[str, Any] | None = None
    """A Ray run: the Ray job's id, the cluster's address, the nodes, the final state and what ended it."""
    study: dict[str, Any] | None = None
    """A trial of a hyperparameter search (``nbddp tune``, ``nbddp.objective``): the study's name, the trial's number,
    its state (``COMPLETE``, ``PRUNED``, ``FAIL``), values, parameters and last step."""
    versions: dict[str, str] = field(default_factory=lambda: versions())
    """nbddp, torch and Python, as installed where the run was launched."""

    def write(self, run_dir: RunDir) -> Path:
        return write_json(run_dir.result, asdict(self), indent=1)

    @classmethod
    def read(cls, run_dir: RunDir) -> "RunRecord | None":
        """The run dir's ``result.json`` (``None`` before the run has ended); fields it doesn't know are ignored."""
        data = read_json(run_dir.result)
        if not isinstance(data, dict):
            return None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def record_job(spec: "JobSpec", launcher: "Launcher", started_at: float, status: Status | str, exit_code: int,
               message: str, rank_exit_codes: dict[int, int], final_metrics: dict[str, Any] | None,
               parameters: dict[str, Any], notebook: str, overrides: dict[str, Any] | None = None,
               command: str = "", failure: dict[str, Any] | None = None) -> RunRecord:
    """``result.json`` of ``spec``'s job, written into its run dir and returned: what ran (engine, devices,
    parameters, command), how it ended (status, exit code, ``message``, the judged ``failure``, each rank's
    exit code, the last metrics: the run dir's when the job was never judged, ``final_metrics`` ``None``) and
    what it left (the weights, torchrun's restarts, the nodes, peak memory, ``launcher``'s scheduler job).

    ``parameters``: every value the run used; ``overrides``: those given on top of the defaults;
    ``failure``: what was judged of the exception that ended it (:meth:`nbddp.contracts.errors.RunError.judged`).
    """
    paths, ended_at = spec.run_dir, time.time()
    record = RunRecord(
        status=str(Status(status)), exit_code=exit_code, notebook=notebook, engine=spec.script.engine,
        devices={"kind": spec.devices.kind, "nproc": spec.devices.nproc}, world_size=spec.world_size,
        parameters=dict(parameters), started_at=started_at, ended_at=ended_at,
        wall_time_s=round(ended_at - started_at, 3),
        rank_exit_codes={str(k): v for k, v in rank_exit_codes.items()},
        final_metrics=last_metrics(paths) if final_metrics is None else final_metrics,
        restarts=paths.restarts(), checkpoint=str(paths.weights) if paths.weights.exists() else None,
        error=message or None, failure=failure, script=str(paths.script), overrides=dict(overrides or {}),
        command=command, nodes=paths.roster(),
        **({launcher.job_record: launcher.job_info(paths)} if launcher.job_record else {}),
        peak_memory={str(rank): peak for rank, peak in read_peaks(paths).items()},
        dropped_output={str(rank): dropped for rank, dropped in paths.dropped_output().items()},
    )
    record.write(paths)
    for said in trackers.record_ending(paths, record, error_line(record.status, record.error, record.failure)):
        print(f"nbddp: {said}", file=sys.stderr, flush=True)
    return record


def error_line(status: str, error: str | None, failure: dict[str, Any] | None) -> str:
    """A run's error in one line, for a batch's summary and terminal: where the notebook's code raised and
    what (``rank 1, cell 3, line 5: ValueError: diverged``; a kernel cell: ``cell 6, line 4: AssertionError:
    (True, 39.61)``), else the first line of its ``error`` (a timeout, an interruption, a rank killed)."""
    failure = failure or {}
    if status == Status.FAILED and failure.get("exc_type"):
        where = [f"{name} {failure[name]}" for name in ("rank", "cell", "line") if failure.get(name) is not None]
        message = " ".join(line.strip() for line in str(failure.get("exc_message") or "").splitlines() if line.strip())
        return f"{', '.join(where) or 'kernel'}: {failure['exc_type']}" + (f": {message}" if message else "")
    return error.strip().splitlines()[0] if error and error.strip() else ""


def versions() -> dict[str, str]:
    """nbddp, torch and Python versions, read from package metadata (no torch import)."""
    import platform
    from importlib import metadata

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return {"nbddp": __version__, "torch": torch_version, "python": platform.python_version()}
