"""nbddp from Python: ``nbddp.run(notebook, ...)`` and ``nbddp.batch(notebook, grid, ...)``.

The same front doors as ``nbddp run`` and ``nbddp batch``: each launch option that the command takes
is a typed keyword argument of its own (derived from the option's one declaration in
:mod:`nbddp.plan.options`), and the keywords build the same :class:`~nbddp.plan.options.LaunchOptions`,
validated the same way. ``import nbddp`` loads this module on first use only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbddp.plan.option_fields import takes_options
from nbddp.plan.options import BATCH, RUN, LaunchOptions, SweepOptions

if TYPE_CHECKING:
    import pandas

    from nbddp.job.orchestrator import RunResult


@takes_options(LaunchOptions, RUN, into="launch")
def run(notebook: str | Path, *, launch: LaunchOptions, output: str | Path | None = None,
        quiet: bool = False) -> RunResult:
    """Run ``notebook`` as ``nbddp run`` does: its training cells as a DDP job, the others in a kernel.

    Returns the :class:`~nbddp.job.orchestrator.RunResult` (``status``, ``exit_code``, ``run_dir``, the
    judged ``outcome``, ``record`` of ``result.json``; ``extra["output"]``: the executed notebook); call
    ``raise_for_status()`` to raise a run that didn't succeed. Every rank's output is printed as it
    comes (``quiet=True``: kept in the run dir only). ``output``: the executed notebook's path
    (default: ``RUN_DIR/output.ipynb``).

    Raises:
        UsageError, NotebookError, CellError, ParameterError, DeviceError: before anything starts.
    """
    from nbddp.doors.notebook_run import RunOptions, run_notebook

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

    def dataframe(self) -> pandas.DataFrame:
        """The rows as a pandas DataFrame (pandas must be installed)."""
        import pandas

        return pandas.DataFrame(self.rows)


@takes_options(SweepOptions, BATCH, into="sweep")
@takes_options(LaunchOptions, BATCH, into="launch")
def batch(notebook: str | Path, grid: Any, *, launch: LaunchOptions, sweep: SweepOptions,
          quiet: bool = False) -> BatchResult:
    """Run ``notebook`` once per parameter set of ``grid`` (a YAML/JSON path, a mapping of name → values,
    or a list of mappings), as ``nbddp batch`` does; ``parameters`` are fixed for every run.

    Raises:
        UsageError, NotebookError, ParameterError, DeviceError: before anything runs.
    """
    from nbddp.doors.batch.schedule import BatchOptions, run_batch

    options = BatchOptions(Path(notebook), grid, launch, **vars(sweep))
    rows, code = run_batch(options, say=(lambda text: None) if quiet else None)
    return BatchResult(rows, Path(rows[0]["run_dir"]).parent if rows else None, code)
