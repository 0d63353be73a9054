"""nbddp from Python: ``nbddp.run(notebook, ...)`` and ``nbddp.batch(notebook, grid, ...)``.

The same front doors as ``nbddp run`` and ``nbddp batch``, with the launch options as typed keyword
arguments (they build the same :class:`~nbddp.options.LaunchOptions`, validated the same way).
``import nbddp`` loads this module on first use only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from nbddp.options import (DEFAULT_COLLECTIVE_TIMEOUT, DEFAULT_RDZV_TIMEOUT, DEFAULT_RETURNS, LaunchOptions, Nodes,
                           RayRequest, SlurmRequest)


def run(notebook: str | Path, *, parameters: Mapping[str, Any] | None = None, gpus: int | str | None = None,
        cpu: bool = False, nproc: int | None = None, engine: str | None = None,
        returns: Sequence[str] | str = DEFAULT_RETURNS, run_dir: str | Path | None = None,
        output: str | Path | None = None, timeout: float | None = None,
        collective_timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT, idle_timeout: float | None = None,
        max_restarts: int = 0, nodes: Nodes | None = None, rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT,
        slurm: SlurmRequest | None = None, ray: RayRequest | None = None, shard: bool = False,
        quiet: bool = False):  # noqa: ANN201 - RunResult (imported lazily)
    """Run ``notebook`` as ``nbddp run`` does: its training cells as a DDP job, the others in a kernel.

    Returns the :class:`~nbddp.job.orchestrator.RunResult` (``status``, ``exit_code``, ``run_dir``, the
    judged ``outcome``, ``record`` of ``result.json``; ``extra["output"]``: the executed notebook); call
    ``raise_for_status()`` to raise a run that didn't succeed. Every rank's output is printed as it
    comes (``quiet=True``: kept in the run dir only).

    Raises:
        UsageError, NotebookError, CellError, ParameterError, DeviceError: before anything starts.
    """
    from nbddp.doors.notebook_run import RunOptions, run_notebook

    launch = _launch(parameters, gpus, cpu, nproc, engine, returns, timeout, collective_timeout, idle_timeout,
                     max_restarts, nodes, rdzv_timeout, slurm, shard, run_dir=run_dir, ray=ray)
    options = RunOptions(Path(notebook), launch, Path(output) if output else None,
                         command=f"nbddp.run({str(notebook)!r}, ...)")
    return run_notebook(options, sinks=[] if quiet else None, say=(lambda text: None) if quiet else None)


@dataclass(frozen=True)
class BatchResult:
    """What ``nbddp.batch`` returns: one row per run (its parameters, status, wall time, final metrics,
    error and run dir), the batch's folder and its exit code."""

    rows: list[dict[str, Any]]
    out: Path | None
    exit_code: int

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0

    def dataframe(self):  # noqa: ANN201 - pandas.DataFrame
        """The rows as a pandas DataFrame (pandas must be installed)."""
        import pandas

        return pandas.DataFrame(self.rows)


def batch(notebook: str | Path, grid: Any, *, parameters: Mapping[str, Any] | None = None,
          gpus_per_run: int | None = None, parallel: int | None = None, out: str | Path | None = None,
          resume: bool = False, fresh: bool = False, gpus: int | str | None = None, cpu: bool = False,
          nproc: int | None = None, engine: str | None = None, returns: Sequence[str] | str = DEFAULT_RETURNS,
          timeout: float | None = None, collective_timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT,
          idle_timeout: float | None = None, max_restarts: int = 0, slurm: SlurmRequest | None = None,
          ray: RayRequest | None = None, shard: bool = False, quiet: bool = False) -> BatchResult:
    """Run ``notebook`` once per parameter set of ``grid`` (a YAML/JSON path, a mapping of name → values,
    or a list of mappings), as ``nbddp batch`` does; ``parameters`` are fixed for every run.

    Raises:
        UsageError, NotebookError, ParameterError, DeviceError: before anything runs.
    """
    from nbddp.doors.batch.schedule import BatchOptions, run_batch

    launch = _launch(parameters, gpus, cpu, nproc, engine, returns, timeout, collective_timeout, idle_timeout,
                     max_restarts, None, DEFAULT_RDZV_TIMEOUT, slurm, shard, ray=ray)
    options = BatchOptions(Path(notebook), grid, launch, gpus_per_run, parallel, Path(out) if out else None,
                           resume, fresh)
    rows, code = run_batch(options, say=(lambda text: None) if quiet else None)
    return BatchResult(rows, Path(rows[0]["run_dir"]).parent if rows else None, code)


def _launch(parameters: Mapping[str, Any] | None, gpus: int | str | None, cpu: bool, nproc: int | None,
            engine: str | None, returns: Sequence[str] | str, timeout: float | None,
            collective_timeout: float | None, idle_timeout: float | None, max_restarts: int, nodes: Nodes | None,
            rdzv_timeout: float, slurm: SlurmRequest | None, shard: bool, run_dir: str | Path | None = None,
            ray: RayRequest | None = None) -> LaunchOptions:
    from nbddp.options import parse_returns

    return LaunchOptions(
        gpus=None if gpus is None else str(gpus), cpu=cpu, nproc=nproc, engine=engine,
        parameters=dict(parameters or {}), returns=parse_returns(returns) if isinstance(returns, str) else tuple(returns),
        run_dir=Path(run_dir) if run_dir else None, timeout=timeout, collective_timeout=collective_timeout,
        idle_timeout=idle_timeout, max_restarts=max_restarts, nodes=nodes, rdzv_timeout=rdzv_timeout, slurm=slurm,
        ray=ray, shard=shard)
