"""nbddp from Python: ``nbddp.run(notebook, ...)``, ``nbddp.batch(notebook, grid, ...)`` and
``nbddp.tune(notebook, space, ...)``.

The same front doors as ``nbddp run``, ``nbddp batch`` and ``nbddp tune``: each launch option that the command takes
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

    from nbddp.doors.tune.study import TuneResult
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


def load_weights(run_dir: str | Path) -> dict[str, Any]:
    """The trained states a finished run returned, read on the CPU from its run dir: ``{"model": state_dict, ...}``
    (a study's best trial: ``nbddp.load_weights(study.best_trial.user_attrs["run_dir"])["model"]``).

    Raises:
        CheckpointError: the run left no weights, or they are not nbddp's.
    """
    from nbddp.contracts.checkpoint import load_returns
    from nbddp.contracts.rundir import RunDir

    states, _ = load_returns(RunDir(Path(run_dir)).weights, mmap=False)
    return states


@takes_options(LaunchOptions, RUN, into="launch")
def tune(notebook: str | Path, space: Any, *, launch: LaunchOptions, trials: int, metric: str | list[str] = "val_loss",
         direction: str | list[str] = "minimize", pruner: str = "median", storage: str | None = None,
         study_name: str | None = None, seed: int | None = None, gpus_per_trial: int | None = None,
         parallel: int | None = None, quiet: bool = False) -> TuneResult:
    """Search ``notebook``'s hyperparameters as ``nbddp tune`` does: an Optuna study of ``trials`` trials, each a run of
    the training cells on the same warm ranks with the trial's values overriding the parameters cell.

    ``space``: a function ``trial → {name: value}`` written with ``trial.suggest_*``, or ``--space`` texts
    (``["lr=loguniform(1e-4,1e-1)"]``). ``metric``: what rank 0 logs with ``nbddp.log`` (several: a multi-objective
    study, one ``direction`` each). ``gpus_per_trial``/``parallel``: trials at once, each on warm ranks of its own
    (``space`` then as texts). Returns the study (``result.study``), the trials this call ran and the exit code.

    Raises:
        UsageError, NotebookError, CellError, ParameterError, DeviceError: before any trial starts.
    """
    from nbddp.doors.tune.study import TuneOptions, run_tune

    metrics = (metric,) if isinstance(metric, str) else tuple(metric)
    directions = (direction,) if isinstance(direction, str) else tuple(direction)
    texts = (space,) if isinstance(space, str) else tuple(space) if isinstance(space, (list, tuple)) else space
    options = TuneOptions(Path(notebook), launch, trials, metrics, texts, directions, pruner, storage, study_name, seed,
                          command=f"nbddp.tune({str(notebook)!r}, ...)", gpus_per_trial=gpus_per_trial,
                          parallel=parallel)
    return run_tune(options, say=(lambda text: None) if quiet else None, table=not quiet)
