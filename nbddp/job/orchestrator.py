"""One run, whichever front door asked for it: the only place the run's path is written.

    devices → warm ranks? → job spec (run dir) → start (launcher seam) → [the kernel's cells]
        → follow → judge → load the weights → [the kernel's remaining cells] → record → result

Every front door builds a :class:`RunRequest` (the script and the options) and calls :func:`run`
with the *kernel* that runs beside the job, which is the only part that differs between doors:

* ``nbddp run`` and the papermill engine: the notebook's other cells in a Jupyter kernel, which
  receives the weights in its training cell (:mod:`nbddp.doors.notebook_kernel`);
* ``%%ddp_train``: the kernel the magic runs in, whose namespace receives them (:class:`InProcess`);
* nodes 1 and up of a multi-node run: nothing (:class:`NoKernel`; node 0 receives the weights).

The kernel calls back into the run at its training cell (``train()``: follow and judge the job),
so the job starts before the kernel does and the two overlap. :func:`run` never raises for a run
that didn't succeed: it returns a :class:`RunResult` carrying the judged outcome, which the door
shows, turns into an exit code, or raises (:meth:`RunResult.raise_for_status`). A Ctrl-C (or the
CLI's SIGTERM/SIGHUP) anywhere stops every rank and is recorded as an interruption.

It chains the stages and nothing else: how a run is shown as it starts and ends is :mod:`nbddp.display`'s
(:func:`~nbddp.display.starting.describe`, :func:`~nbddp.display.ending.ending_of`), what the user must know
of its topology the launchers' (:func:`nbddp.launchers.topology_notes`).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from nbddp.contracts.devices import Devices
from nbddp.contracts.errors import CheckpointError, RunError, RunFailed, SignalReceived, stop_signal
from nbddp.contracts.rank_env import RankEnv
from nbddp.job.debugger import Console
from nbddp.job.follow import Sink
from nbddp.job.lifecycle import Job
from nbddp.job.outcome import JobOutcome, run_error, stopped
from nbddp.job.record import RunRecord, versions
from nbddp.job import trackers
from nbddp.contracts.rundir import RunDir, create_run_dir
from nbddp.plan.job_spec import JobSpec, WarmHandle
from nbddp.contracts.status import Status
from nbddp.launchers import devices_for, topology_notes
from nbddp.notebook.script import Script
from nbddp.plan.options import LaunchOptions, asked_trackers

Say = Callable[[str], None]


class WarmSource(Protocol):
    """Where a door's warm ranks come from: the kernel's own pool, or the pool a batch keeps for its slot."""

    def pool_for(self, devices: Devices, cwd: Path, launch: LaunchOptions) -> tuple[WarmHandle | None, str]:
        """``(pool or None, a line to say)``: warm ranks that can take this run, or why it starts fresh ones."""

    def after_run(self, pool: WarmHandle, status: Status) -> None:
        """The run on ``pool`` ended with ``status`` (ranks whose run did not succeed can't be trusted)."""

    def held_gpus(self) -> tuple[str, ...]:
        """The GPUs (NVML UUIDs) its live ranks hold, when they were chosen by name: free to this door's runs
        (``--gpus free``, ``--wait``), though NVML shows the ranks on them."""


@dataclass(frozen=True)
class RunRequest:
    """One run, as a front door asks for it."""

    script: Script
    launch: LaunchOptions
    notebook: Path
    """The notebook the run is named after: its run dir is ``runs/<stem>-<time>`` beside it."""
    cwd: Path
    """The ranks' working folder (the notebook's: its local modules import as in the kernel)."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """Every parameter value the run uses (defaults with the overrides applied), for ``result.json``."""
    overrides: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    """How the run was started, for ``result.json``."""
    source: str | None = None
    """How ``result.json`` names where the code came from (default: the notebook's path)."""
    owner: str = "cli"
    """``cli``: a process that stops its own job when ``nbddp kill`` signals it (``detached``: a detached
    run's supervisor, the same); ``kernel``: a process that must never be signalled (a Jupyter kernel,
    papermill), whose job ``nbddp kill`` stops itself."""
    warm: WarmSource | None = None
    """Where warm ranks come from, when this door uses them."""
    kernel_records: dict[str, str] = field(default_factory=dict)
    """The experiment records a kernel that is not this process had open as it asked for the run (a detached
    ``%%ddp_train``), for rank 0 to write into (:func:`nbddp.job.trackers.open_records`)."""
    console: Console | None = None
    """Where a rank's debugger is relayed (a ``breakpoint()``, ``--debug-on-failure``): the kernel's input box, the
    terminal; ``None``: nobody can type into one (papermill, a batch, a detached run), so breakpoints are skipped."""
    debug_on_failure: bool = False
    """``nbddp run --debug-on-failure``: a rank's uncaught exception opens a post-mortem before the rank ends."""
    tracked: bool = True
    """Whether the run is an experiment's (``False``: ``%%ddp_exec``, a look at the ranks: it writes into no record
    of the kernel's, asks for none, and nbddp adds nothing to what its code may write)."""
    said: set[str] | None = field(default=None, compare=False)
    """What this door's user was told of the machine already (a kernel's: each line once per kernel, not in every
    cell); ``None``: a door that runs once says it every time."""

    @property
    def origin(self) -> str:
        """Where the code came from, as ``result.json`` and the trackers name it (:attr:`source`, else the notebook)."""
        return self.source or str(self.notebook)

    @property
    def relayed_console(self) -> Console | None:
        """Where a rank's debugger is relayed: from this machine's run dir only. Ranks on other machines (Slurm, Ray,
        ``--nnodes``) skip their breakpoints, as a run nobody can type into does."""
        launch = self.launch
        return None if launch.slurm or launch.ray or launch.nodes is not None else self.console


@dataclass
class KernelResult:
    """How the kernel beside the job fared: what it loaded, or how it failed."""

    loaded: list[str] = field(default_factory=list)
    """The names the trained weights were loaded into."""
    note: str = ""
    """More about the weights (the checkpoint Catalyst kept; ``node 0 holds the weights``)."""
    status: Status = Status.SUCCEEDED
    exit_code: int = 0
    message: str = ""
    """Why a kernel cell failed (naming the notebook, the cell and the error)."""
    error: BaseException | None = None
    """What to raise for it (a :class:`~nbddp.contracts.errors.CheckpointError`, a
    :class:`~nbddp.contracts.errors.RunFailed`)."""

    @classmethod
    def failed(cls, message: str, status: Status = Status.FAILED, error: BaseException | None = None,
               **judged: Any) -> "KernelResult":
        """``judged``: what is known of the exception (:data:`nbddp.contracts.errors.JUDGED`: ``exc_type``,
        ``cell``, ``line``…)."""
        return cls(status=status, exit_code=status.exit_code, message=message,
                   error=error or (RunFailed(message, **judged) if status is Status.FAILED else None))


Train = Callable[..., JobOutcome]
"""``train(deadline=None, name=None)``: follow the job until it ends and judge it (the kernel calls it at its
training cell); ``deadline``, a monotonic time that ``name`` names, may only shorten the run's ``--timeout``."""


class Kernel(Protocol):
    """What runs beside the job and receives its weights (a door's kernel subclasses it for the defaults)."""

    def run(self, job: Job, train: Train, deadline: float | None) -> KernelResult:
        """Run until done, calling ``train()`` once where the training belongs; ``deadline``: ``--timeout``."""

    def shares_records_later(self) -> bool:
        """Whether the kernel's cells before the training may open an experiment record (an MLflow run, …),
        which it then shares at its training cell, for rank 0 to write into (:mod:`nbddp.job.trackers`)."""
        return False

    def records_now(self, request: RunRequest) -> tuple[dict[str, str], list[str]]:
        """``(variables for the ranks, what each names)``: the experiment records open as the run starts, for rank 0
        to write into. A kernel in another process had them open as it asked for the run
        (:attr:`RunRequest.kernel_records`; their store's credentials from this process's environment)."""
        return trackers.own_credentials(request.kernel_records), []


class InProcess(Kernel):
    """This process's own namespace receives the weights (``%%ddp_train``: the kernel it runs in)."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace

    def records_now(self, request: RunRequest) -> tuple[dict[str, str], list[str]]:
        return trackers.open_records()  # (this process's own, read as the job starts)

    def run(self, job: Job, train: Train, deadline: float | None) -> KernelResult:
        if train().status != Status.SUCCEEDED:
            return KernelResult()
        if not job.script.returns:
            return KernelResult()  # (the orchestrator says why nothing came back)
        return self.load(job.checkpoint)

    def load(self, checkpoint: Path) -> KernelResult:
        """The trained weights in ``checkpoint`` loaded into the namespace (a detached run's too, once attached)."""
        from nbddp.contracts.checkpoint import load_into, load_returns

        try:
            states, note = load_returns(checkpoint)
            return KernelResult(loaded=load_into(self.namespace, states), note=note)
        except CheckpointError as exc:
            return KernelResult.failed(f"the trained weights could not be loaded: {exc}", error=exc)


class NoKernel(Kernel):
    """No kernel: nodes 1 and up of a multi-node run (node 0's kernel receives the weights), or a detached
    ``%%ddp_train``'s supervisor (its weights wait in the run dir for a kernel to attach)."""

    def __init__(self, note: str = "", once_weights: bool = False) -> None:
        self.note = note
        self.once_weights = once_weights
        """Say :attr:`note` only when the run succeeded and its weights are in the run dir."""

    def run(self, job: Job, train: Train, deadline: float | None) -> KernelResult:
        succeeded = train().status == Status.SUCCEEDED and job.checkpoint.exists()
        return KernelResult(note=self.note if succeeded or not self.once_weights else "")


@dataclass
class RunResult:
    """How a run ended, whichever door started it: the judged outcome and what came back."""

    status: Status
    exit_code: int
    run_dir: Path
    """The run's folder, as the user is shown it (its files: :attr:`paths`)."""
    message: str = ""
    """Why it didn't succeed (``""`` when it did)."""
    record: RunRecord | None = None
    outcome: JobOutcome | None = None
    """The job's judged outcome (``None`` if the job never got to be judged)."""
    kernel: KernelResult = field(default_factory=KernelResult)
    interrupted_by: int | None = None
    """The signal that interrupted the run (Ctrl-C: SIGINT), if one did."""
    ended_by: str = ""
    """What ended it when it didn't succeed: ``interrupt``, ``job`` or ``kernel``."""
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    """What the door adds (``nbddp run``: ``output``, the executed notebook's path, and ``executed``)."""

    @property
    def succeeded(self) -> bool:
        return self.status == Status.SUCCEEDED

    @property
    def paths(self) -> RunDir:
        """The run dir's files (``weights.pt``, ``output.ipynb``, …), named by the one owner of their names."""
        return RunDir(self.run_dir)

    @property
    def loaded(self) -> list[str]:
        return self.kernel.loaded

    def error(self) -> BaseException | None:
        """The exception that says why the run didn't succeed (``None`` when it did)."""
        if self.succeeded:
            return None
        if self.ended_by == "job" and self.outcome is not None:
            return run_error(self.outcome, self.run_dir)
        if self.ended_by == "kernel" and self.kernel.error is not None:
            return self.kernel.error
        from nbddp.contracts.errors import error_for

        return error_for(self.status, self.message, self.exit_code, str(self.run_dir))

    def raise_for_status(self) -> None:
        """Raise why the run didn't succeed: the judged :class:`~nbddp.contracts.errors.RunError` (it carries the
        status, rank, exception type, cell and line), or what failed in the kernel."""
        error = self.error()
        if error is not None:
            raise error


def run(request: RunRequest, kernel: Kernel, sinks: Sequence[Sink], say: Say,
        on_start: Callable[[Job], Any] | None = None, heartbeat: Callable[[], Any] | None = None) -> RunResult:
    """Run ``request``'s job with ``kernel`` beside it, streaming every rank to ``sinks``.

    ``say``: one line for the user (the door adds its prefix); ``on_start(job)``: once the ranks are
    starting (a view appears); ``heartbeat()``: on every poll while the job runs (whatever it raises
    stops the job; a ``KeyboardInterrupt`` is an interruption).

    Raises:
        UsageError, DeviceError: before anything starts (bad options, devices that aren't there).
    """
    started = time.monotonic()
    devices = _devices(request, say)
    pool = _warm_pool(request, devices, say)
    spec, records = _job_spec(request, kernel, devices, pool, say)
    trackers.start_tracking(spec, request.parameters, request.origin,
                            asked_trackers(request.launch) if request.tracked else (), records,
                            request.tracked and kernel.shares_records_later(), versions()["torch"], request.tracked)
    following = _Following(request, sinks, heartbeat)
    result = RunResult(Status.FAILED, Status.FAILED.exit_code, spec.run_dir.path)
    try:
        with Job.start(spec) as following.job:
            following.beside(kernel, result, on_start)
            _conclude(result, following.trained, warm=pool is not None)
            result.seconds = time.monotonic() - started
            result.record = _record(following.job, request, result)
    except Exception as exc:  # nbddp itself broke: record it, then let it be seen
        if following.job is not None and result.record is None:
            following.job.record(Status.FAILED, 1, f"{type(exc).__name__}: {exc}", None, request.parameters,
                                 request.origin, request.overrides, request.command)
        _warm_after_run(request, pool, Status.FAILED)
        raise
    _warm_after_run(request, pool, result.status)
    return result


def _devices(request: RunRequest, say: Say) -> Devices:
    """The run's devices, once what was chosen and what the user must know of the machine is said."""
    if request.script.note:
        say(request.script.note)  # no cell is marked: which cells nbddp chose
    for notice in request.script.notices:
        say(notice)
    ours = request.warm.held_gpus() if request.warm is not None else ()
    devices = devices_for(request.launch, asked=request.script.processes, say=say, ours=ours)
    for note in _news([devices.note] if devices.note else [], request.said) + topology_notes(request.launch):
        say(note)
    return devices


def _job_spec(request: RunRequest, kernel: Kernel, devices: Devices, pool: WarmHandle | None,
              say: Say) -> tuple[JobSpec, dict[str, str]]:
    """The job's spec (its run dir made) and the experiment records open as it starts (rank 0 writes into them)."""
    records, names = kernel.records_now(request) if request.tracked else ({}, [])
    if names:
        say(trackers.start_line(names))
    console = request.relayed_console
    ranks = RankEnv(debugger=console is not None, debug_on_failure=request.debug_on_failure and console is not None)
    spec = JobSpec(request.script, devices, create_run_dir(request.notebook, request.launch.run_dir, say), request.cwd,
                   launch=request.launch, owner=request.owner, pool=pool,
                   environment={**trackers.rank_variables(records), **ranks.variables()})
    return spec, records


class _Following:
    """The job as the kernel beside it meets it: :meth:`train` follows and judges it where the training belongs."""

    def __init__(self, request: RunRequest, sinks: Sequence[Sink], heartbeat: Callable[[], Any] | None) -> None:
        self.request, self.sinks, self.heartbeat = request, sinks, heartbeat
        self.console = request.relayed_console
        timeout = request.launch.timeout
        self.deadline = time.monotonic() + timeout if timeout else None
        self.judged: list[JobOutcome] = []
        self.job: Job | None = None

    @property
    def trained(self) -> bool:
        """Whether the kernel got to its training cell (the job was followed and judged there)."""
        return bool(self.judged)

    def train(self, own_deadline: float | None = None, name: str | None = None) -> JobOutcome:
        """Follow the job until it ends and judge it; ``own_deadline`` (named ``name``) may only come sooner."""
        limit, limit_name = self.deadline, "--timeout"
        if own_deadline is not None and (limit is None or own_deadline < limit):
            limit, limit_name = own_deadline, name or limit_name
        self.judged.append(self.job.wait(self.sinks, limit, self.request.launch.idle_timeout, self.heartbeat,
                                         deadline_name=limit_name, console=self.console))
        return self.judged[-1]  # (every rank was stopped first, however it ended)

    def beside(self, kernel: Kernel, result: RunResult, on_start: Callable[[Job], Any] | None) -> None:
        """Run ``kernel`` beside the started job, into ``result``: what the kernel loaded, the judged outcome, and
        the interruption that ended it early, if one did (the job stopped and judged then)."""
        try:
            if on_start is not None:  # (a Ctrl-C or nbddp kill landing here is an interruption too)
                on_start(self.job)
            result.kernel = kernel.run(self.job, self.train, self.deadline)
            if not self.request.script.returns and not result.kernel.note:  # (nothing to load: say why)
                result.kernel = replace(result.kernel, note=self.request.script.returns_note)
        except (KeyboardInterrupt, SignalReceived) as exc:
            result.interrupted_by = stop_signal(exc)
        if not self.trained:  # interrupted, or the kernel stopped before the training
            self.job.stop()
            self.judged.append(self.job.outcome(timed_out=result.kernel.status == Status.TIMEOUT,
                                                interrupted_by=result.interrupted_by))
        result.outcome = self.judged[-1]


def _record(job: Job, request: RunRequest, result: RunResult) -> RunRecord:
    """The run's ``result.json``, with what judged it when it failed."""
    error = result.error()
    return job.record(result.status, result.exit_code, result.message, result.outcome, request.parameters,
                      request.origin, overrides=request.overrides, command=request.command,
                      failure=error.judged() if isinstance(error, RunError) else None)


def _news(facts: list[str], said: set[str] | None) -> list[str]:
    """The facts of the machine (``no GPU visible: running on the CPU…``) this door's user wasn't told yet, remembered
    as told (``said``: a kernel's, for its lifetime; ``None``: each is news)."""
    if said is None:
        return facts
    news = [fact for fact in facts if fact not in said]
    said.update(news)
    return news


def _conclude(result: RunResult, trained: bool, warm: bool = False) -> None:
    """The run's status, exit code and message, from what ended it first: an interruption; a kernel cell
    that failed before the training (the job was stopped for it); the job; a kernel cell after it. ``warm``: the
    ranks were a warm pool's (a stop ends their job, not them)."""
    outcome, kernel = result.outcome, result.kernel
    if result.interrupted_by is not None:
        name = signal.Signals(result.interrupted_by).name
        result.status, result.message = Status.INTERRUPTED, f"interrupted ({name}); {stopped(warm)}."
        result.exit_code, result.ended_by = Status.INTERRUPTED.code(result.interrupted_by), "interrupt"
    elif kernel.status != Status.SUCCEEDED and not trained or outcome.status == Status.SUCCEEDED:
        result.status, result.exit_code, result.message = kernel.status, kernel.exit_code, kernel.message
        result.ended_by = "kernel" if kernel.status != Status.SUCCEEDED else ""
    else:
        result.status, result.exit_code, result.message = outcome.status, outcome.exit_code, outcome.message
        result.ended_by = "job"


def _warm_pool(request: RunRequest, devices: Devices, say: Say) -> WarmHandle | None:
    """The warm ranks this run goes to, if its door has them and they can take it (the one rule)."""
    if request.warm is None:
        return None
    from nbddp.launchers.warm.rules import why_not_warm

    why = why_not_warm(request.script.engine, request.launch)
    if why:
        say(f"{why}: starting fresh ones")
        return None
    pool, note = request.warm.pool_for(devices, request.cwd, request.launch)
    if note:
        say(note)
    return pool


def _warm_after_run(request: RunRequest, pool: WarmHandle | None, status: Status) -> None:
    if pool is not None and request.warm is not None:
        request.warm.after_run(pool, status)
