"""``nbddp tune NOTEBOOK`` and ``nbddp.tune(notebook, ...)``: an Optuna study over a notebook's training cells, every
trial on the same warm ranks of the command's own.

The notebook's setup cells run once on the warm ranks, which keep what they built; each trial runs the training
cells with the trial's values as ``-p`` overrides (:class:`~nbddp.doors.tune.objective.NotebookTrials`). Direction,
sampler, pruner and storage are Optuna's. With ``--storage`` (an RDB URL, ``sqlite:///study.db``) the study is
Optuna's own record: ``nbddp tune`` run again with it resumes the study where it stopped; a trial whose process was
killed is found by its heartbeat (Optuna's), marked ``FAIL`` and its values run again, so no trial is lost.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from nbddp.contracts.devices import resolve
from nbddp.contracts.errors import UsageError
from nbddp.doors.tune.objective import (INTERRUPTED_ATTR, RUN_DIR_ATTR, NotebookTrials, Objective, TrialEnd,
                                       group_trials, refuse_unknown, require_optuna, safe_name, tracked_as)
from nbddp.doors.tune.parallel import Tickets, run_workers, stop_if_orphaned, trial_slots, workers
from nbddp.doors.tune.space import CommandLineSpace, Space, parse_space
from nbddp.job.follow import Event
from nbddp.plan.options import LaunchOptions

if TYPE_CHECKING:
    import optuna

#: ``--pruner``'s choices (Optuna's pruners).
PRUNERS = ("median", "hyperband", "none")
#: Optuna's heartbeat for a study in a storage: how often a running trial says it is alive, and how long after its last
#: word a trial counts as its process gone (then marked FAIL and run again: the study resumes where it stopped).
HEARTBEAT_SECONDS, STALE_SECONDS = 2, 6
#: A retried trial's attribute: the number of the trial whose process was gone.
RETRY_OF = "nbddp_retry_of"


@dataclass(frozen=True)
class TuneOptions:
    """A study as ``nbddp tune`` and ``nbddp.tune()`` ask for it."""

    notebook: Path
    launch: LaunchOptions
    trials: int
    metric: tuple[str, ...]
    space: Space | tuple[str, ...]
    """``--space`` texts (:func:`~nbddp.doors.tune.space.parse_space`), or a function ``trial → dict``."""
    direction: tuple[str, ...] = ("minimize",)
    pruner: str = "median"
    storage: str | None = None
    study_name: str | None = None
    seed: int | None = None
    command: str = ""
    gpus_per_trial: int | None = None
    """GPUs per trial: trials run at once on this machine's GPUs, ``G // K`` of them (:mod:`.parallel`)."""
    parallel: int | None = None
    """Trials at once (on CPU: each with ``--nproc`` processes; on GPUs: at most this many slots)."""
    worker: str | None = None
    """``PID:TICKETS``: this process is one of a concurrent study's workers (:mod:`.parallel`), started by ``PID``."""

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise UsageError(f"--trials {self.trials}: need at least 1")
        if self.pruner not in PRUNERS:
            raise UsageError(f"--pruner {self.pruner}: one of {', '.join(PRUNERS)}")
        if len(self.direction) not in (1, len(self.metric)):
            raise UsageError(f"--direction: give one, or one per --metric ({len(self.metric)})")
        wrong = [d for d in self.direction if d not in ("minimize", "maximize")]
        if wrong:
            raise UsageError(f"--direction {wrong[0]}: minimize or maximize")
        if self.launch.run_dir is not None:
            raise UsageError("nbddp tune writes each trial's run dir under runs/STUDY/trial-N: drop --run-dir")
        if self.storage is not None and self.storage.split(":", 1)[0].split("+")[0] not in (
                "sqlite", "postgresql", "mysql", "oracle", "mssql"):
            raise UsageError(f"--storage {self.storage}: give a database URL Optuna stores studies in, e.g. "
                             "sqlite:///study.db")


@dataclass
class TuneResult:
    """What ``nbddp.tune`` returns: the Optuna study, each trial this call ran in this process (none for trials run
    at once: their workers' are in ``study``), and the exit code."""

    study: Any
    ends: list[TrialEnd]
    exit_code: int

    @property
    def best_params(self) -> dict[str, Any]:
        return dict(self.study.best_trial.params)


def run_tune(options: TuneOptions, say: Callable[[str], None] | None = None, table: bool = True) -> TuneResult:
    """Run the study; ``say``: where its lines go (default: stderr); ``table``: print the table of trials at the end
    (stdout). Never raises for a trial that failed.

    Raises:
        UsageError, NotebookError, CellError, ParameterError, DeviceError: before any trial starts.
    """
    say = say or _stderr
    if options.worker is None and (options.gpus_per_trial or options.parallel):
        slots, kind = trial_slots(options.launch, options.gpus_per_trial, options.parallel, say)
        if len(slots) > 1:
            return _concurrent(options, slots, kind, say, table)
        if kind == "cuda":
            options = replace(options, launch=replace(options.launch, gpus=str(len(slots[0]))))
    return _in_process(options, say, table)


def _in_process(options: TuneOptions, say: Callable[[str], None], table: bool) -> TuneResult:
    """The study in this process, every trial on its warm ranks (a concurrent study's worker: the trials it takes)."""
    from nbddp.launchers import KernelPool
    from nbddp.notebook.reader import read_notebook

    parent, tickets = _worker(options.worker)
    space = parse_space(options.space) if isinstance(options.space, tuple) else options.space
    keeper = KernelPool()  # (%%ddp_train's: its starter imports torch while Optuna loads and the study starts)
    trials = NotebookTrials(read_notebook(options.notebook), options.launch, keeper, command=options.command)
    if isinstance(space, CommandLineSpace):
        refuse_unknown(space.names, trials.takes(), trials.fixed)  # (a function's names: by the objective)
    if options.launch.nproc in (None, resolve().nproc):  # (the starter is made for a default run's ranks)
        keeper.prepare()
    try:
        optuna = require_optuna()
        objective = Objective(trials, space, options.metric, TerminalStudy(say, parent), groups=tickets is None)
        study = _study(optuna, options, trials.notebook.path.stem)
        left = options.trials - len(_finished(optuna, study))
        if tickets is None:
            retried = _resume(optuna, study, say)
            if left <= 0 and not retried:
                say(f"nbddp: study {study.study_name}: its {options.trials} trials are done")
            study.optimize(objective, n_trials=max(left, 0), gc_after_trial=False)
        while tickets is not None:  # (a worker: a trial at a time, while the study has some left)
            stop_if_orphaned(parent)
            if not tickets.take():
                break
            study.optimize(objective, n_trials=1, gc_after_trial=False)
    finally:
        keeper.stop()
    if table and tickets is None:
        print(trial_table(study, options.metric), flush=True)
    ran = any(end.state == "COMPLETE" for end in objective.ends)
    return TuneResult(study, objective.ends, 0 if ran or left <= 0 or tickets is not None else 1)


def _worker(worker: str | None) -> tuple[int | None, Tickets | None]:
    """``--worker PID:TICKETS`` → the parent's pid and the study's tickets (``(None, None)``: not a worker)."""
    if worker is None:
        return None, None
    pid, _, path = worker.partition(":")
    return int(pid), Tickets(Path(path))


def _concurrent(options: TuneOptions, slots: list[tuple[str, ...]], kind: str, say: Callable[[str], None],
                table: bool) -> TuneResult:
    """The study's trials run at once, one worker process per device slot (:mod:`.parallel`), sharing the study
    through its storage (``--storage``, else a SQLite file in the study's folder)."""
    from nbddp.contracts.owned import private_folder
    from nbddp.notebook.reader import read_notebook

    if not isinstance(options.space, tuple):
        raise UsageError("concurrent trials (--gpus-per-trial, --parallel) take the space as --space texts: each "
                         "worker process reads it (a space function lives in this process only)")
    space = parse_space(options.space)
    notebook = read_notebook(options.notebook)
    checked = NotebookTrials(notebook, options.launch, None)  # everything checked here, before any worker starts
    refuse_unknown(space.names, checked.takes(), checked.fixed)
    optuna = require_optuna()
    name = options.study_name or (notebook.path.stem if options.storage else _timed(notebook.path.stem))
    folder = private_folder(checked.runs / safe_name(name), "the study's folder", parents=True, say=say)
    options = replace(options, study_name=name, storage=options.storage or f"sqlite:///{folder / 'study.db'}")
    study = _study(optuna, options, notebook.path.stem)
    first = len(study.get_trials(deepcopy=False))
    left = options.trials - len(_finished(optuna, study))
    _resume(optuna, study, say)
    nproc = resolve(cpu=True, nproc=options.launch.nproc).nproc
    each = (f"GPUs {' | '.join(','.join(slot) for slot in slots)}" if kind == "cuda" else
            f"{nproc} CPU process{'es' if nproc > 1 else ''}")
    say(f"nbddp: {len(slots)} trials at once, each on {each}")
    study_argv = ["--trials", str(options.trials), *(w for m in options.metric for w in ("--metric", m)),
                  *(w for d in options.direction for w in ("--direction", d)), "--pruner", options.pruner,
                  "--storage", options.storage, "--study-name", name]
    with tracked_as(folder):
        codes = run_workers(workers(notebook.path, options.space, options.launch, slots, kind, study_argv,
                                    Tickets(folder / "tickets", max(left, 0)).path,
                                    None if options.seed is None else options.seed + first), say)
    ran = study.get_trials(deepcopy=False)[first:]
    ends = [(Path(t.user_attrs[RUN_DIR_ATTR]), t.state.name) for t in ran if RUN_DIR_ATTR in t.user_attrs]
    for line in group_trials(folder, ends):
        say(f"nbddp: {line}")
    for code in codes:
        if code not in (0, 1):
            say(f"nbddp: a worker exited {code}: its lines above say why")
    if table:
        print(trial_table(study, options.metric), flush=True)
    ok = any(t.state == optuna.trial.TrialState.COMPLETE for t in ran) or left <= 0
    return TuneResult(study, [], 0 if ok and all(code in (0, 1) for code in codes) else 1)


def _timed(stem: str) -> str:
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _study(optuna: Any, options: TuneOptions, stem: str) -> optuna.Study:
    """The study: Optuna's, in ``--storage`` with a heartbeat (loaded where it is already), else in memory."""
    directions = list(options.direction) * (len(options.metric) if len(options.direction) == 1 else 1)
    pruner = {"median": optuna.pruners.MedianPruner, "hyperband": optuna.pruners.HyperbandPruner,
              "none": optuna.pruners.NopPruner}[options.pruner]()
    storage = None
    if options.storage is not None:
        try:
            with warnings.catch_warnings():  # (the heartbeat is "experimental" since Optuna 2.9: said on every start)
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(options.storage, heartbeat_interval=HEARTBEAT_SECONDS,
                                                     grace_period=STALE_SECONDS)
        except Exception as exc:  # noqa: BLE001 - SQLAlchemy's many errors: one line
            raise UsageError(f"--storage {options.storage}: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    name = options.study_name or (stem if storage is not None else _timed(stem))
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # (nbddp says each trial, a failed one too, in one line)
    try:
        study = optuna.create_study(storage=storage, study_name=name, load_if_exists=True, directions=directions,
                                    pruner=pruner)
    except ValueError as exc:
        raise UsageError(f"study {name}: {exc}") from None
    stored = [d.name.lower() for d in study.directions]
    if stored != directions:  # (Optuna loads a stored study as it was stored, whatever was asked)
        raise UsageError(f"study {name} in {options.storage} optimises {', '.join(stored)}; this asks "
                         f"{', '.join(directions)} ({len(options.metric)} --metric): give its --direction and as many "
                         "--metric, or a new --study-name")
    # --seed: the same trials again for a new study; a resumed one goes on from its trials (the same seed would
    # draw its first trials' values again). A concurrent study's worker is given its own by the study's process.
    resumed = 0 if options.worker is not None else len(study.get_trials(deepcopy=False))
    seed = None if options.seed is None else options.seed + resumed
    study.sampler = optuna.samplers.TPESampler(seed=seed)
    return study


def _finished(optuna: Any, study: optuna.Study) -> list[Any]:
    """The study's trials that count towards ``--trials``: those that ended, less those stopped before their end
    (their process gone, or the study interrupted), whose values run again."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get(RETRY_OF) for t in trials}
    return [t for t in trials if t.state in states and t.number not in retried and INTERRUPTED_ATTR not in t.user_attrs]


def _resume(optuna: Any, study: optuna.Study, say: Callable[[str], None]) -> list[int]:
    """The trials a stopped study left unfinished, their values enqueued to run first: those interrupted (a Ctrl-C,
    a SIGTERM), and those left running by a process that is gone (its heartbeat stopped; marked FAIL here). A trial
    whose heartbeat is still fresh is waited for, up to Optuna's grace period: it may be another live process's
    (then it is left to it). Returns the trials' numbers."""
    fail, running = optuna.trial.TrialState.FAIL, optuna.trial.TrialState.RUNNING
    stale = [t.number for t in study.get_trials(deepcopy=False, states=(running,))]
    deadline = time.monotonic() + STALE_SECONDS + HEARTBEAT_SECONDS
    while stale:
        with warnings.catch_warnings():  # (Optuna calls the heartbeat "experimental" each time it is used)
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        if all(t.state != running for t in study.get_trials(deepcopy=False) if t.number in stale) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.5)
    trials = study.get_trials(deepcopy=False)
    done = {t.user_attrs.get(RETRY_OF) for t in trials}
    retried = []
    for trial in trials:
        interrupted = INTERRUPTED_ATTR in trial.user_attrs
        if trial.state != fail or trial.number in done or not (interrupted or trial.number in stale):
            continue  # (a trial that ran to its end, one run again already, another live process's)
        said = (f"nbddp: trial {trial.number} was "
                + ("interrupted" if interrupted else "running when the study's last process stopped: marked FAIL"))
        if trial.params:  # (a process stopped before its trial had values leaves nothing to run again)
            study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})
            retried.append(trial.number)
            said += "; its values run again first"
        say(said)
    return retried


def trial_table(study: optuna.Study, metrics: tuple[str, ...]) -> str:
    """Every trial of the study (number, state, parameters, values, last step, time), then the best one."""
    trials = study.get_trials(deepcopy=False)
    names = sorted({name for t in trials for name in t.params})
    header = ["trial", "state", *names, *metrics, "step", "seconds"]
    rows = [header]
    for t in trials:
        seconds = (t.datetime_complete - t.datetime_start).total_seconds() \
            if t.datetime_complete and t.datetime_start else None
        values = list(t.values or [None] * len(metrics))
        rows.append([str(t.number), t.state.name, *(_cell(t.params.get(n)) for n in names),
                     *(_cell(v) for v in values), _cell(t.last_step), _cell(seconds and round(seconds, 1))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.append(best_line(study, metrics))
    return "\n".join(lines)


def best_line(study: optuna.Study, metrics: tuple[str, ...]) -> str:
    """``best: trial 7 · val_loss=0.0123 · lr=0.01 hidden=64 · runs/…/trial-7`` (several objectives: the best
    trials' numbers)."""
    if len(study.directions) > 1:
        best = study.best_trials
        return f"best (Pareto front): trials {', '.join(str(t.number) for t in best)}" if best else "no trial completed"
    try:
        trial = study.best_trial
    except ValueError:
        return "no trial completed"
    params = " ".join(f"{k}={_cell(v)}" for k, v in trial.params.items())
    return (f"best: trial {trial.number} · {metrics[0]}={_cell(trial.value)} · {params} · "
            f"{trial.user_attrs.get(RUN_DIR_ATTR, '')}")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


class TerminalStudy:
    """A study in a terminal: one line per trial as it ends, nbddp's own lines once (the ranks' output is in each
    trial's run dir). ``parent``: a concurrent study's worker's parent, whose death stops the trial's job."""

    def __init__(self, say: Callable[[str], None], parent: int | None = None) -> None:
        self._say, self.parent = say, parent

    def trial_started(self, number: int, params: dict[str, Any]) -> None:
        return None

    def event(self, event: Event) -> None:
        return None

    def heartbeat(self) -> None:
        stop_if_orphaned(self.parent)

    def say(self, line: str) -> None:
        self._say(f"nbddp: {line}")

    def trial_ended(self, end: TrialEnd, best: float | None) -> None:
        self._say(f"nbddp: {end.line()}" + (f" · best {best:.6g}" if best is not None else ""))


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
