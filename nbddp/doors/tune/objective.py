"""The Optuna objective every door shares: a trial is one run of the training cell on warm ranks.

A trial's values override the names the training code takes, as ``-p`` does (checked the same way, type warnings
included). While the run goes, every value rank 0 logs for the metric (``nbddp.log(val_loss=v, step=s)``) is reported
to the trial the moment the job's follower reads it (``trial.report``); when ``trial.should_prune()`` says so, the
next poll of the follow loop (≤ 0.05 s later) stops the job as a Ctrl-C does, which on warm ranks ends the job and
keeps the ranks, and the trial ends ``PRUNED``. A run that fails ends its trial ``FAIL`` with the run's error in one
line, the objective returning NaN (Optuna's way to fail a trial and go on with the study); a stop by the user stops
the study. The trial's value is the metric's last logged value, or ``value(result)``.

What differs between doors is where the training code comes from (:class:`Trials`: a notebook file here, the kernel's
last ``%%ddp_train`` cell in :mod:`nbddp.doors.jupyter.tune`) and how trials are shown (:class:`Shown`).
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, Sequence

from nbddp.contracts.errors import SignalReceived, UsageError, stop_signal
from nbddp.contracts.metrics import measures, read_metrics, step_of
from nbddp.contracts.rundir import RunDir
from nbddp.doors.tune.space import Space, probed_names
from nbddp.job import orchestrator
from nbddp.job.follow import Event, MetricsEvent, Sink
from nbddp.job.record import RunRecord, error_line

if TYPE_CHECKING:
    import optuna

    from nbddp.notebook.reader import Notebook
    from nbddp.plan.options import LaunchOptions

#: Said when Optuna isn't installed.
INSTALL_OPTUNA = "hyperparameter search needs Optuna: pip install 'nbddp[tune]' (or pip install optuna)"
#: How the orchestrator's note on the run after an interrupted one starts (after a pruned trial: not said).
PRUNED_NOTE = "the last run was interrupted"
#: Said once to Optuna's ``n_jobs`` > 1: the trials of one objective share one set of warm ranks.
ONE_AT_A_TIME = ("n_jobs > 1: this objective's trials share one set of warm ranks, so they run one after another "
                 "(trials at once: nbddp tune --parallel J, or --gpus-per-trial K, each on ranks of its own)")
#: A trial's attributes in the study (``study.best_trial.user_attrs["run_dir"]``: where its weights are; an
#: interrupted trial's signal, whose values a resumed study runs again).
RUN_DIR_ATTR, ERROR_ATTR, INTERRUPTED_ATTR = "run_dir", "error", "nbddp_interrupted"


def require_optuna() -> Any:
    """Optuna, or one line saying how to install it."""
    try:
        import optuna
    except ImportError:
        raise UsageError(INSTALL_OPTUNA) from None
    return optuna


class Trials(Protocol):
    """Where a door's trials come from: the training code, the names it takes, and one run of it."""

    runs: Path
    """The folder each study's trial run dirs go under (``runs/`` beside the notebook)."""
    launch: LaunchOptions
    """Every trial's launch options."""
    fixed: tuple[str, ...]
    """The names the user fixed for every trial (the command's ``-p``): a space may not search them too."""

    def takes(self) -> tuple[str, ...]:
        """The names the training code takes from outside (those a trial's values may set)."""

    def run(self, values: dict[str, Any], run_dir: Path, sinks: Sequence[Sink], heartbeat: Callable[[], Any],
            say: Callable[[str], None]) -> orchestrator.RunResult:
        """One run with ``values`` overriding the names the code takes, its run dir ``run_dir``."""


class Shown(Protocol):
    """How a door shows a study as it goes (a line per trial; the kernel's view adds the plots)."""

    def trial_started(self, number: int, params: dict[str, Any]) -> None: ...

    def event(self, event: Event) -> None:
        """A rank's line or ``nbddp.log`` record of the running trial."""

    def heartbeat(self) -> None: ...

    def say(self, line: str) -> None:
        """A line of nbddp's about the runs (said once per study)."""

    def trial_ended(self, end: "TrialEnd", best: float | None) -> None: ...


@dataclass
class TrialEnd:
    """How one trial ended, as shown and recorded."""

    number: int
    params: dict[str, Any]
    state: str
    """Optuna's: ``COMPLETE``, ``PRUNED`` or ``FAIL``."""
    values: tuple[float, ...] = ()
    step: int | None = None
    """The last step reported (a pruned trial's: the step it was pruned at)."""
    seconds: float = 0.0
    error: str = ""
    run_dir: Path | None = None

    def line(self) -> str:
        """``trial 3 · lr=0.01 hidden=64 · val_loss=0.1234 · 1.2 s`` (or ``PRUNED at step 2``, ``FAIL: why``)."""
        params = params_text(self.params)
        if self.state == "PRUNED":
            outcome = f"PRUNED at step {self.step}"
        elif self.state == "FAIL":
            outcome = f"FAIL: {self.error}"
        else:
            outcome = " ".join(f"{value:.6g}" for value in self.values)
        return f"trial {self.number} · {params or '(no values)'} · {outcome} · {self.seconds:.1f} s"


def params_text(params: dict[str, Any]) -> str:
    """A trial's values in a line: ``lr=0.01235 opt=adam`` (what its line and the study's view show)."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


class _Stop(KeyboardInterrupt):
    """Raised by the follow loop's heartbeat once the trial is to be pruned (or its study's storage failed): the job
    stops as a Ctrl-C stops it (warm ranks leave the job and stay), and the objective ends the trial."""


class StudyInterrupted(KeyboardInterrupt):
    """The study was stopped during a trial (a Ctrl-C, or ``signum``: the command's SIGTERM): the trial's job was
    stopped and the trial ends FAIL, marked so that a resumed study runs its values again. A Ctrl-C for Optuna (which
    then ends its loop), shown by IPython as its one line."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31mKeyboardInterrupt\x1b[0m: {self}"]


class _Watch:
    """A trial's sink and heartbeat: reports the metric as it is logged, and stops the job once it is to be pruned."""

    def __init__(self, trial: optuna.Trial, metric: str, reports: bool, shown: Shown) -> None:
        self.trial, self.metric, self.reports, self.shown = trial, metric, reports, shown
        self.step: int | None = None
        self.pruned_at: int | None = None
        self.storage_error = ""
        """Why the study's storage refused a report (the trial then ends FAIL saying so)."""
        self.count = 0

    def __call__(self, event: Event) -> None:
        self.shown.event(event)
        if not isinstance(event, MetricsEvent) or self.pruned_at is not None or self.storage_error:
            return
        value = _number(event.values.get(self.metric))
        if value is None:
            return
        self.step = step_of(event.values, self.count)
        self.count += 1
        if not self.reports:
            return
        try:
            self.trial.report(value, self.step)
            if self.trial.should_prune():
                self.pruned_at = self.step
        except Exception as exc:  # noqa: BLE001 - a database's many errors (locked, gone): the trial fails in one line
            self.storage_error = f"the study's storage failed: {type(exc).__name__}: {exc}".splitlines()[0]

    def heartbeat(self) -> None:
        self.shown.heartbeat()
        if self.pruned_at is not None or self.storage_error:
            raise _Stop(self.storage_error or f"pruned at step {self.pruned_at}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class Objective:
    """Optuna's objective over ``trials`` (``study.optimize(objective, n_trials=N)``)."""

    def __init__(self, trials: Trials, space: Space, metric: str | Sequence[str], shown: Shown,
                 value: Callable[[orchestrator.RunResult], Any] | None = None, groups: bool = True) -> None:
        self.optuna = require_optuna()
        self.trials, self.space, self.shown, self.value = trials, space, shown, value
        self.groups = groups
        """Whether this objective groups the trials' tracker records (a concurrent study's worker doesn't: the
        study's process groups them all)."""
        self.metrics = (metric,) if isinstance(metric, str) else tuple(metric)
        if not self.metrics or not all(isinstance(m, str) and m for m in self.metrics):
            raise UsageError("metric: name the value rank 0 logs with nbddp.log (metric='val_loss'), or several")
        self.said: set[str] = set()
        self.ends: list[TrialEnd] = []
        self.running = threading.Lock()
        names = probed_names(space)
        if names is not None:
            self.check_names(names)  # refused before the first trial

    def check_names(self, names: Sequence[str]) -> None:
        """Refuse a space's name the training code doesn't take, or that ``-p`` fixes (:func:`refuse_unknown`)."""
        refuse_unknown(names, self.trials.takes(), self.trials.fixed)

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, ...]:
        if not self.running.acquire(blocking=False):  # (Optuna's n_jobs > 1: threads sharing one set of warm ranks)
            self._say(ONE_AT_A_TIME)
            self.running.acquire()
        try:
            return self._trial(trial)
        except StudyInterrupted:
            raise
        except (KeyboardInterrupt, SignalReceived) as exc:  # (before or after the trial's run: the same)
            trial.set_user_attr(INTERRUPTED_ATTR, stop_signal(exc))
            raise StudyInterrupted(f"the study was stopped during trial {trial.number}", stop_signal(exc)) from None
        finally:
            self.running.release()

    def _trial(self, trial: optuna.Trial) -> float | tuple[float, ...]:
        values = self.space(trial)
        if not isinstance(values, dict):
            raise UsageError(f"the space must return a dict of parameter values; it returned {type(values).__name__}")
        self.check_names(list(values))
        single = len(trial.study.directions) == 1
        if single != (len(self.metrics) == 1):
            raise UsageError(f"the study has {len(trial.study.directions)} direction(s) and the objective "
                             f"{len(self.metrics)} metric(s) ({', '.join(self.metrics)}): give as many of each")
        watch = _Watch(trial, self.metrics[0], single, self.shown)
        self.shown.trial_started(trial.number, values)
        folder = self.trials.runs / safe_name(trial.study.study_name)
        run_dir = trial_dir(self.trials.runs, trial.study.study_name, trial.number)
        trial.set_user_attr(RUN_DIR_ATTR, str(run_dir))
        started = time.monotonic()
        try:
            with tracked_as(folder):
                result = self.trials.run(values, run_dir, [watch], watch.heartbeat, self._say)
        except BaseException as exc:  # refused before its run started (a value its cell can't take): said, then raised
            self.shown.trial_ended(TrialEnd(trial.number, values, "FAIL", seconds=time.monotonic() - started,
                                            error=f"{type(exc).__name__}: {exc}".splitlines()[0]), None)
            raise
        end = TrialEnd(trial.number, values, "COMPLETE", step=watch.step, seconds=time.monotonic() - started,
                       run_dir=result.run_dir)
        try:
            return self._judge(trial, result, watch, end)
        finally:
            _note_study(result.paths, trial, end)
            self.ends.append(end)
            if self.groups:
                for line in group_trials(folder, [(e.run_dir, e.state) for e in self.ends]):
                    self._say(line)
            self.shown.trial_ended(end, _best(trial.study, end))

    def _judge(self, trial: optuna.Trial, result: orchestrator.RunResult, watch: _Watch,
               end: TrialEnd) -> float | tuple[float, ...]:
        if watch.storage_error:
            return self._fail(trial, end, watch.storage_error)
        if watch.pruned_at is not None:
            end.state, end.step = "PRUNED", watch.pruned_at
            raise self.optuna.TrialPruned(f"pruned at step {watch.pruned_at}")
        if result.interrupted_by is not None:  # the user's Ctrl-C (or a signal): the study stops
            end.state, end.error = "FAIL", "interrupted"
            trial.set_user_attr(INTERRUPTED_ATTR, result.interrupted_by)
            raise StudyInterrupted(f"the study was stopped during trial {trial.number}; its job was stopped, the "
                                   "warm ranks kept", result.interrupted_by)
        if not result.succeeded:
            record = result.record
            line = (error_line(record.status, record.error, record.failure) if record else "") or result.message
            return self._fail(trial, end, line or str(result.status))
        if self.value is not None:
            values = self.value(result)
            end.values = tuple(values) if isinstance(values, (tuple, list)) else (float(values),)
            return values
        logged = _last_values(result.paths)
        missing = [m for m in self.metrics if m not in logged]
        if missing:
            seen = sorted(measures(logged))
            line = (f"the run never logged {', '.join(missing)} with nbddp.log"
                    + (f" (it logged {', '.join(seen)})" if seen else " (it logged no metric)"))
            if not any(e.state == "COMPLETE" for e in self.ends):  # (a misspelt metric would fail every trial alike)
                self._fail(trial, end, line)
                raise UsageError(f"{line}: the study stops here; name the metric its training logs"
                                 + (f" ({' or '.join(seen)})" if seen else " (nbddp.log(val_loss=v, step=s))"))
            return self._fail(trial, end, line)
        unfinished = [f"{m} was {logged[m][0]} at step {logged[m][1]}" for m in self.metrics
                      if not math.isfinite(logged[m][0])]
        if unfinished:  # (a diverged run: its last finite value would be an early, better one)
            return self._fail(trial, end, f"{'; '.join(unfinished)} (the training diverged?)")
        end.values = tuple(logged[m][0] for m in self.metrics)
        return end.values[0] if len(end.values) == 1 else end.values

    def _fail(self, trial: optuna.Trial, end: TrialEnd, line: str) -> float | tuple[float, ...]:
        """The trial ends FAIL with ``line`` (NaN: Optuna fails the trial and goes on with the study)."""
        end.state, end.error = "FAIL", line
        trial.set_user_attr(ERROR_ATTR, line)
        nan = float("nan")
        return nan if len(self.metrics) == 1 else tuple(nan for _ in self.metrics)

    def _say(self, line: str) -> None:
        """nbddp's lines about the runs, each once per study (20 trials say "on the same warm ranks" once); not the
        note that the last run was interrupted after a trial the study pruned (that is what pruning is)."""
        if self.ends and self.ends[-1].state == "PRUNED" and line.startswith(PRUNED_NOTE):
            return
        key = re.sub(r"\d+(\.\d+)?", "N", line)
        if key not in self.said:
            self.said.add(key)
            self.shown.say(line)


def refuse_unknown(names: Sequence[str], takes: Sequence[str], fixed: Iterable[str] = ()) -> None:
    """Refuse a space's name the training code doesn't take, in one line naming it (and the name it likely meant), or
    one that ``-p`` also fixes (``fixed``: which of the two the user meant can't be told).

    Raises:
        UsageError: such a name.
    """
    from nbddp.notebook.parameters import closest_parameter

    both = [name for name in names if name in set(fixed)]
    if both:
        raise UsageError(f"{', '.join(both)}: both fixed (-p) and searched (the space): drop one of the two")

    unknown = [name for name in names if name not in takes]
    if unknown:
        hints = [hint for name in unknown if (hint := closest_parameter(name, list(takes)))]
        raise UsageError(f"the search space gives {', '.join(unknown)}, which the training code doesn't read"
                         + (f"; it reads {', '.join(takes)}" if takes else
                            " (it takes no value from outside: define the names in a parameters cell)")
                         + (f". Did you mean {' / '.join(hints)}?" if hints else ""))


def _last_values(paths: RunDir) -> dict[str, tuple[float, int]]:
    """Each metric's last value among the run's ``nbddp.log`` records (NaN and infinities included: a run that
    diverged ends with them), and the step it was logged at."""
    values: dict[str, tuple[float, int]] = {}
    for index, record in enumerate(read_metrics(paths)):
        for name, value in record.items():
            if name != "time" and isinstance(value, (int, float)) and not isinstance(value, bool):
                values[name] = (float(value), step_of(record, index))
    return values


def _best(study: optuna.Study, end: TrialEnd) -> float | None:
    """The study's best value so far, ``end``'s trial included (Optuna counts it once the objective has returned;
    ``None``: none yet, or several objectives)."""
    if len(study.directions) != 1:
        return None
    try:
        best = study.best_value
    except ValueError:
        best = None
    if end.state != "COMPLETE" or not end.values:
        return best
    pick = max if study.direction.name == "MAXIMIZE" else min
    return end.values[0] if best is None else pick(best, end.values[0])


def _note_study(paths: RunDir, trial: optuna.Trial, end: TrialEnd) -> None:
    """The trial's ``result.json`` names the study and the trial (its number, state, values and step)."""
    record = RunRecord.read(paths)
    if record is None:
        return
    record.study = {"name": trial.study.study_name, "trial": trial.number, "state": end.state,
                    "params": dict(end.params), "values": list(end.values), "step": end.step}
    if end.state == "PRUNED":
        record.error = f"pruned at step {end.step} by the study's pruner: the job was stopped, the warm ranks kept"
    elif end.error and not record.error:
        record.error = end.error  # (a metric never logged: the run itself succeeded)
    record.write(paths)


@contextmanager
def tracked_as(folder: Path) -> Iterator[None]:
    """The trials' tracker records grouped by the study's folder, as a batch's are by its own (``NBDDP_BATCH``: a W&B
    group and TensorBoard sub-folders as each run writes; MLflow's parent run by :func:`group_trials`)."""
    from nbddp.job.trackers import BATCH_VARIABLE

    before = os.environ.get(BATCH_VARIABLE)
    os.environ[BATCH_VARIABLE] = str(folder)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BATCH_VARIABLE, None)
        else:
            os.environ[BATCH_VARIABLE] = before


def group_trials(folder: Path, ends: Sequence[tuple[Path | None, str]]) -> list[str]:
    """The study's MLflow runs (``ends``: each trial's run dir and state) nested under one parent run named by the
    study, finished once a trial completed (pruned and failed trials are a study's normal work). Warning lines."""
    from nbddp.job.trackers import group_batch

    completed = any(state == "COMPLETE" for _, state in ends)
    runs = [(RunDir(path), completed) for path, _ in ends if path is not None]
    return group_batch(folder, runs) if runs and folder.is_dir() else []


def safe_name(name: str) -> str:
    """A study's name as a folder's: letters, digits, ``.``, ``_`` and ``-`` (names are data, never a path)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "study"
    return cleaned[:100]


def trial_dir(runs: Path, study: str, number: int) -> Path:
    """``runs/STUDY/trial-N`` (``trial-N-2`` where an earlier study of that name left one)."""
    base = runs / safe_name(study)
    candidate = base / f"trial-{number}"
    n = 2
    while candidate.exists():
        candidate, n = base / f"trial-{number}-{n}", n + 1
    return candidate


@dataclass
class NotebookTrials:
    """A notebook file's trials: its training cells with the trial's values as ``-p`` overrides of its parameters
    cell, on ``warm`` ranks (the same setup cells: the ranks keep it, and run again what a value changes)."""

    notebook: Notebook
    launch: LaunchOptions
    warm: orchestrator.WarmSource | None
    command: str = ""
    owner: str = "cli"
    said: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        from nbddp.notebook.script import generate

        self.script = generate(self.notebook, self.launch.export_options(), to_run=True)  # checked before any trial

    @property
    def runs(self) -> Path:
        return self.notebook.path.resolve().parent / "runs"

    @property
    def fixed(self) -> tuple[str, ...]:
        return tuple(self.launch.parameters)

    def takes(self) -> tuple[str, ...]:
        return tuple(self.script.parameters)

    def run(self, values: dict[str, Any], run_dir: Path, sinks: Sequence[Sink], heartbeat: Callable[[], Any],
            say: Callable[[str], None]) -> orchestrator.RunResult:
        from nbddp.notebook.script import generate

        launch = replace(self.launch, parameters={**self.launch.parameters, **values}, run_dir=run_dir)
        script = generate(self.notebook, launch.export_options(), to_run=True)
        request = orchestrator.RunRequest(
            script, launch, self.notebook.path, self.notebook.path.resolve().parent, script.parameters,
            dict(launch.parameters), self.command, owner=self.owner, warm=self.warm, said=self.said)
        return orchestrator.run(request, orchestrator.NoKernel(), sinks, say, heartbeat=heartbeat)
