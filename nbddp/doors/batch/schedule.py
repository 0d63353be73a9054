"""``nbddp batch``: one notebook, a grid of parameter sets, each a full ``nbddp run``.

Each run is a separate ``nbddp run`` process (its own kernel, job, run dir and
executed notebook), so a failure or a crash stays inside its run. One loop in
the main thread starts runs as devices free up and watches them: no worker
threads, so every child is tied to a thread that lives as long as the batch
(see :mod:`nbddp.rank_side.parent_death`). Runs are identified by their parameters, which is
what ``--resume`` matches on.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

from nbddp.contracts.atomic import read_json
from nbddp.contracts.devices import FREE, free_devices, gpu_usage, requested_gpus, resolve, visible_gpu_count
from nbddp.contracts.errors import DeviceError, NbddpError, ParameterError, UsageError, stop_signal
from nbddp.contracts.owned import private_folder
from nbddp.job.trackers import BATCH_VARIABLE, group_batch
from nbddp.launchers import BatchSlots, run_stop_grace
from nbddp.notebook.reader import Notebook, read_notebook
from nbddp.plan.options import SLURM_PARALLEL, LaunchOptions, SweepOptions, machine_gpus_refusal
from nbddp.contracts.status import BatchState, Status
from nbddp.notebook.parameters import check_overrides, declared_parameters
from nbddp.notebook.literals import check_name, is_plain_data
from nbddp.contracts.process_groups import stop_groups
from nbddp.contracts.rundir import RunDir
from nbddp.notebook.script import engine_of
from nbddp.contracts.interpreter import module_argv

POLL_SECONDS = 0.2


@dataclass(frozen=True)
class PlannedRun:
    index: int
    name: str
    parameters: dict[str, Any]

    @property
    def key(self) -> str:
        """Identity of a run for ``--resume``: its parameters, not its position."""
        return json.dumps(self.parameters, sort_keys=True, default=repr)


@dataclass(frozen=True)
class BatchOptions(SweepOptions):
    """A batch: the notebook, its grid, every run's launch options, and the batch's own options
    (:class:`~nbddp.plan.options.SweepOptions`, declared with the launch options)."""

    notebook: Path
    grid: Any
    """A path to a YAML/JSON file, or the grid itself (mapping of lists, or list of mappings)."""
    launch: LaunchOptions = LaunchOptions()
    """Every run's launch options (``launch.parameters``: fixed for every run; no run dir: each run gets one)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.launch.run_dir is not None:
            raise UsageError("a batch gives each run its own run dir under --out; --run-dir is for one run.")
        if self.launch.nodes is not None:
            raise UsageError("a batch spans several nodes with --slurm (each run becomes a Slurm job); with "
                             "--nnodes every node would have to start the same runs in lockstep on one port. "
                             "Use --slurm, or `nbddp run --nnodes` on each node for one run.")
        if (self.launch.gpus is not None and self.gpus_per_run is not None
                and str(self.launch.gpus) != str(self.gpus_per_run)):
            raise UsageError("--gpus and --gpus-per-run both say how many GPUs a run uses: give one.")
        if self.gpus_per_run is not None and self.launch.cluster_flag is not None:
            raise UsageError(machine_gpus_refusal("--gpus-per-run", self.launch))  # (the cluster places each run)

    @property
    def per_run_gpus(self) -> int | None:
        if self.gpus_per_run is not None:
            return self.gpus_per_run
        return None if self.launch.gpus is None else requested_gpus(self.launch.gpus)

    @property
    def per_run_flag(self) -> str:
        """How the user asked for each run's GPUs, as they typed it (``--gpus 4`` or ``--gpus-per-run 4``)."""
        return f"--gpus-per-run {self.gpus_per_run}" if self.gpus_per_run is not None else f"--gpus {self.launch.gpus}"


def load_grid(grid: Any) -> list[dict[str, Any]]:
    """The parameter sets of a grid: a YAML or JSON file's path, the same text given inline (``--grid '{"lr": [0.1,
    0.2]}'``, ``--grid 'lr: [0.1, 0.2]'``: what isn't a file), a mapping of name → values, or a list of mappings."""
    if isinstance(grid, (str, Path)):
        path = Path(grid)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            inline = _inline_grid(str(grid))
            if inline is None:
                raise ParameterError(f"--grid {path}: cannot read it ({exc.strerror or exc}); give a YAML or JSON "
                                     "file, or the grid itself: --grid '{\"lr\": [0.1, 0.2]}'.") from None
            grid = inline
        else:
            grid = _parse_grid_text(text, path)
    if isinstance(grid, dict):
        for name, values in grid.items():
            if not isinstance(values, list) or not values:
                raise ParameterError(f"grid: {name!r} must map to a non-empty list of values, not {values!r}.")
        names = list(grid)
        sets = [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]
    elif isinstance(grid, list) and all(isinstance(item, dict) for item in grid) and grid:
        sets = [dict(item) for item in grid]
    else:
        raise ParameterError("a grid is a mapping of parameter name → list of values, or a non-empty list of mappings.")
    for values in sets:
        for name, value in values.items():
            check_name(name)
            if not is_plain_data(value):
                raise ParameterError(f"grid: the value of {name!r} must be plain data, not {type(value).__name__}.")
    return sets


def _inline_grid(text: str) -> Any:
    """``text`` as a grid given inline (a mapping or a list, in YAML, which JSON is a part of), or ``None``."""
    import yaml

    try:
        found = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return found if isinstance(found, (dict, list)) else None


def _parse_grid_text(text: str, path: Path) -> Any:
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ParameterError(f"--grid {path}: not valid JSON ({exc}).") from None
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        raise ParameterError(f"--grid {path}: reading YAML needs pyyaml (pip install pyyaml), or use JSON.") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ParameterError(f"--grid {path}: not valid YAML ({exc}).") from None


def plan(notebook: Notebook, sets: list[dict[str, Any]], fixed: dict[str, Any]) -> list[PlannedRun]:
    """Check every name against the parameters cell, then name the runs.

    Raises:
        ParameterError: a name the parameters cell doesn't define (papermill only warns).
    """
    if not declared_parameters(notebook):
        raise ParameterError(f"{notebook.path}: no 'parameters' cell, so a batch has nothing to vary. "
                             "Tag the cell that sets the hyperparameters 'parameters' "
                             "(or start it with '#| parameters').")
    check_overrides(notebook, {n for values in sets for n in values} | set(fixed))
    runs = []
    for index, values in enumerate(sets, start=1):
        parameters = {**values, **fixed}
        label = "-".join(f"{k}={_short(v)}" for k, v in values.items())
        name = re.sub(r"[^A-Za-z0-9._=+-]+", "_", f"{index:03d}-{label}")[:90].rstrip("_-")
        runs.append(PlannedRun(index, name, parameters))
    return runs


def _short(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=repr)


@dataclass
class RunState:
    run: PlannedRun
    run_dir: Path
    process: subprocess.Popen | None = None
    slot: int = -1
    """The index of the device slot it runs in (CPU slots have no GPU ids, so only the index tells them apart)."""
    started: float = 0.0
    status: BatchState = BatchState.PENDING

    @property
    def paths(self) -> RunDir:
        """Its run dir's files (the folder itself is moved aside as ``.tryN`` when the run is tried again)."""
        return RunDir(self.run_dir)


class Batch:
    """Schedules the planned runs onto device slots and records how each ended."""

    def __init__(self, options: BatchOptions, out: Path, runs: list[PlannedRun], slots: list[tuple[str, ...]],
                 nproc: int, device_kind: str, progress: Callable[["Batch"], None] | None = None,
                 engine: str = "torch") -> None:
        self.options, self.out, self.runs = options, out, runs
        self.slots = slots
        self.free_slots = list(range(len(slots)))
        self.nproc, self.device_kind = nproc, device_kind
        self.progress = progress or (lambda batch: None)
        self.states = [RunState(r, out / r.name) for r in runs]
        self.warm = BatchSlots(engine, options.launch, options.fresh, Path(options.notebook).resolve().parent)
        """Each device slot's warm ranks, kept between its runs (by the rule ``%%ddp_train``'s are kept by)."""

    def run(self) -> list[RunState]:
        pending = [s for s in self.states if not self._finished_before(s)]
        running: list[RunState] = []
        try:
            while pending or running:
                while pending and self.free_slots:
                    state = pending.pop(0)
                    self._start(state, self.free_slots.pop(0))
                    running.append(state)
                for state in list(running):
                    if state.process.poll() is not None:
                        self._finish(state)
                        running.remove(state)
                self.progress(self)
                time.sleep(POLL_SECONDS)
        except BaseException as exc:
            self._stop_all(running, stop_signal(exc))
            raise
        finally:
            self.warm.stop()
        self.progress(self)
        return self.states

    def _finished_before(self, state: RunState) -> bool:
        """``--resume``: a run whose parameters already succeeded in this folder is skipped."""
        if not self.options.resume:
            return False
        for ended in RunDir.ended_under(self.out):
            data = read_json(ended.result)
            if not isinstance(data, dict):
                continue
            overrides = data.get("overrides", data.get("parameters"))  # result.json before nbddp 0.2: overrides only
            if (data.get("status") == Status.SUCCEEDED
                    and json.dumps(overrides, sort_keys=True, default=repr) == state.run.key):
                state.run_dir, state.status = ended.path, BatchState.SKIPPED
                return True
        return False

    def _start(self, state: RunState, index: int) -> None:
        slot = self.slots[index]
        if state.run_dir.exists():  # an earlier failed or interrupted try: keep it, beside
            attempt = 1
            while state.run_dir.with_name(f"{state.run_dir.name}.try{attempt}").exists():
                attempt += 1
            state.run_dir.rename(state.run_dir.with_name(f"{state.run_dir.name}.try{attempt}"))
        state.run_dir.mkdir(parents=True, mode=0o700)
        env = {**os.environ, BATCH_VARIABLE: str(self.out)}  # (its runs' records grouped: nbddp.job.trackers)
        devices: dict[str, Any] = {"cpu": True, "nproc": self.nproc, "gpus": None}
        if self.device_kind in ("slurm", "ray"):  # the cluster's: as the options say
            devices = {}
        elif self.device_kind == "cuda":
            devices = {"cpu": False, "nproc": None, "gpus": str(len(slot))}
            env["CUDA_VISIBLE_DEVICES"] = ",".join(slot)
        launch = replace(self.options.launch, parameters=state.run.parameters, run_dir=state.run_dir, **devices)
        argv = module_argv("nbddp", "run", str(self.options.notebook), "-o", str(state.paths.output),
                           *launch.to_argv())
        with open(state.paths.batch_log, "ab") as log:
            self.warm.hand_to(index, launch, len(slot) or None, env, log)
            state.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True)
        state.slot, state.started, state.status = index, time.monotonic(), BatchState.RUNNING

    def _finish(self, state: RunState) -> None:
        self.free_slots.append(state.slot)
        code = state.process.returncode
        state.status = _status_of(state.paths, code)
        self.warm.slot_run_ended(state.slot, Status(state.status.value))

    def _stop_all(self, running: Sequence[RunState], sig: int = signal.SIGTERM) -> None:
        """Pass ``sig``, what stopped the batch, on to every running run (each stops its ranks and kernel, and
        records it: the user's Ctrl-C as SIGINT, ``nbddp kill``'s SIGTERM as SIGTERM), then SIGKILL stragglers."""
        stop_groups([s.process.pid for s in running], sig, grace=run_stop_grace(self.options.launch),
                    reap=lambda: [s.process.poll() for s in running])
        for state in running:
            try:
                state.process.wait(timeout=5)
            except subprocess.TimeoutExpired:  # out of its group (it can't be: SIGKILL it by pid)
                state.process.kill()
                state.process.wait()
            state.status = _status_of(state.paths, state.process.returncode, default=BatchState.INTERRUPTED)


def _status_of(run_dir: RunDir, code: int | None, default: BatchState = BatchState.FAILED) -> BatchState:
    """How a run ended, from its ``result.json`` (its exit code when it wrote none)."""
    try:
        return BatchState((read_json(run_dir.result) or {})["status"])
    except (ValueError, KeyError, TypeError):
        return BatchState.SUCCEEDED if code == 0 else default


def device_slots(options: BatchOptions, say: Callable[[str], None]) -> tuple[list[tuple[str, ...]], int, str]:
    """``(slots, nproc, kind)``: each slot is the GPU ids one run gets (empty on CPU).

    Raises:
        DeviceError: a run needs more GPUs than are visible.
    """
    if options.launch.slurm is not None:  # Slurm places each run's job; its devices are the job's
        return [() for _ in range(options.parallel or SLURM_PARALLEL)], options.launch.nproc or 0, "slurm"
    # Ray places each run's ranks; one at a time unless --parallel (a run the cluster can't place in --rdzv-timeout
    # fails)
    if options.launch.ray is not None:
        return [() for _ in range(options.parallel or 1)], options.launch.nproc or 0, "ray"
    free = str(options.launch.gpus or "").lower() == FREE
    chosen = free_devices(None, gpu_usage()) if free else None  # (each run then gets its slot's GPUs by name)
    gpus = 0 if options.launch.cpu else chosen.nproc if chosen else visible_gpu_count()
    if chosen is not None:
        say(f"nbddp: --gpus free: {chosen.note}")
    if gpus == 0:
        if options.per_run_gpus:
            raise DeviceError(f"{options.per_run_flag}: no GPU is visible. Use --cpu --nproc N.")
        devices = resolve(cpu=True, nproc=options.launch.nproc)
        if not options.launch.cpu:
            say(f"nbddp: no GPU visible: each run uses {devices.nproc} CPU processes (gloo).")
        return [() for _ in range(options.parallel or 1)], devices.nproc, "cpu"
    per_run = options.per_run_gpus or 1
    if per_run > gpus:
        raise DeviceError(f"{options.per_run_flag} asks for more GPUs per run than the {gpus} visible.")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = list(chosen.gpu_ids) if chosen else [i.strip() for i in visible.split(",")][:gpus] if visible else [
        str(i) for i in range(gpus)]
    slots = [tuple(ids[i * per_run:(i + 1) * per_run]) for i in range(gpus // per_run)]
    if options.parallel:
        slots = slots[: options.parallel]
    return slots, per_run, "cuda"


def default_out(notebook: Path) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return notebook.resolve().parent / "batches" / f"{notebook.stem}-{stamp}"


def run_batch(options: BatchOptions, progress: Callable[[Batch], None] | None = None,
              say: Callable[[str], None] | None = None) -> tuple[list[dict[str, Any]], int]:
    """Plan, check, run and summarize a batch. Returns ``(rows, exit code)``.

    Bad input (grid, names, devices) raises before anything runs.
    """
    from nbddp.doors.batch.summary import summarize

    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    notebook = read_notebook(options.notebook)
    runs = plan(notebook, load_grid(options.grid), options.launch.parameters)
    slots, nproc, kind = device_slots(options, say)
    out = Path(options.out) if options.out else default_out(options.notebook)
    if options.resume and not out.exists():
        raise NbddpError(f"--resume: {out} does not exist; give the --out of the batch to resume.")
    private_folder(out, "--out", parents=True, say=lambda text: say(f"nbddp: {text}"))
    say(f"nbddp: batch of {len(runs)} runs, {min(len(slots), len(runs))} at a time, in {out}")
    engine = engine_of(notebook, options.launch.engine, options.launch.train_cell)
    batch = Batch(options, out, runs, slots, nproc, kind, progress, engine)
    try:
        states = batch.run()
    finally:
        rows = summarize(out, [(s.run, s.paths, s.status) for s in batch.states])
        for line in group_batch(out, [(s.paths, s.status.ok) for s in batch.states]):  # (after the summary: a
            say(f"nbddp: {line}")  # store that is slow to answer never costs it)
    failed = [s for s in states if not s.status.ok]
    return rows, Status.FAILED.exit_code if failed else Status.SUCCEEDED.exit_code
