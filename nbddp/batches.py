"""``nbddp batch``: one notebook, a grid of parameter sets, each a full ``nbddp run``.

Each run is a separate ``nbddp run`` process (its own kernel, job, run dir and
executed notebook), so a failure or a crash stays inside its run. One loop in
the main thread starts runs as devices free up and watches them: no worker
threads, so every child is tied to a thread that lives as long as the batch
(see :mod:`nbddp.guard`). Runs are identified by their parameters, which is
what ``--resume`` matches on.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

from nbddp.cells import INJECTED, PARAMETERS, cell_role
from nbddp.devices import resolve, visible_gpu_count
from nbddp.errors import DeviceError, NbddpError, ParameterError
from nbddp.notebook import Notebook, read_notebook
from nbddp.parameters import check_name, is_plain_data

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 12.0


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
class BatchOptions:
    notebook: Path
    grid: Any
    """A path to a YAML/JSON file, or the grid itself (mapping of lists, or list of mappings)."""
    parameters: dict[str, Any] = field(default_factory=dict)
    gpus_per_run: int | None = None
    cpu: bool = False
    nproc: int | None = None
    parallel: int | None = None
    out: Path | None = None
    resume: bool = False
    engine: str | None = None
    timeout: float | None = None
    collective_timeout: float | None = None
    idle_timeout: float | None = None


def load_grid(grid: Any) -> list[dict[str, Any]]:
    """The parameter sets of a grid: a file path, a mapping of name → values, or a list of mappings."""
    if isinstance(grid, (str, Path)):
        path = Path(grid)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ParameterError(f"--grid {path}: cannot read it ({exc.strerror or exc}).") from None
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


def declared_parameters(notebook: Notebook) -> list[str]:
    """Names assigned in the notebook's ``parameters`` cell(s)."""
    names: list[str] = []
    for cell in notebook.code_cells:
        if cell_role(cell, notebook.path) not in (PARAMETERS, INJECTED):
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name) and sub.id not in names:
                        names.append(sub.id)
    return names


def plan(notebook: Notebook, sets: list[dict[str, Any]], fixed: dict[str, Any]) -> list[PlannedRun]:
    """Check every name against the parameters cell, then name the runs.

    Raises:
        ParameterError: a name the parameters cell doesn't define (papermill only warns).
    """
    declared = declared_parameters(notebook)
    if not declared:
        raise ParameterError(f"{notebook.path}: no 'parameters' cell, so a batch has nothing to vary. "
                             "Tag the cell that sets the hyperparameters 'parameters' (or start it with '#| parameters').")
    unknown = sorted(({n for values in sets for n in values} | set(fixed)) - set(declared))
    if unknown:
        raise ParameterError(f"{notebook.path}: unknown parameter{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                             f"the parameters cell defines {', '.join(declared)}.")
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
    slot: tuple[str, ...] = ()
    started: float = 0.0
    status: str = "pending"


class Batch:
    """Schedules the planned runs onto device slots and records how each ended."""

    def __init__(self, options: BatchOptions, out: Path, runs: list[PlannedRun], slots: list[tuple[str, ...]],
                 nproc: int, device_kind: str, progress: Callable[["Batch"], None] | None = None) -> None:
        self.options, self.out, self.runs = options, out, runs
        self.free_slots = list(slots)
        self.nproc, self.device_kind = nproc, device_kind
        self.progress = progress or (lambda batch: None)
        self.states = [RunState(r, out / r.name) for r in runs]

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
        except BaseException:
            self._stop_all(running)
            raise
        self.progress(self)
        return self.states

    def _finished_before(self, state: RunState) -> bool:
        """``--resume``: a run whose parameters already succeeded in this folder is skipped."""
        if not self.options.resume:
            return False
        for result in self.out.glob("*/result.json"):
            try:
                data = json.loads(result.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if data.get("status") == "succeeded" and json.dumps(data.get("parameters"), sort_keys=True, default=repr) == state.run.key:
                state.run_dir, state.status = result.parent, "skipped"
                return True
        return False

    def _start(self, state: RunState, slot: tuple[str, ...]) -> None:
        if state.run_dir.exists():  # an earlier failed or interrupted try: keep it, beside
            attempt = 1
            while state.run_dir.with_name(f"{state.run_dir.name}.try{attempt}").exists():
                attempt += 1
            state.run_dir.rename(state.run_dir.with_name(f"{state.run_dir.name}.try{attempt}"))
        state.run_dir.mkdir(parents=True, mode=0o700)
        argv = [sys.executable, "-m", "nbddp.cli", "run", str(self.options.notebook),
                "--run-dir", str(state.run_dir), "-o", str(state.run_dir / "output.ipynb")]
        for name, value in state.run.parameters.items():
            argv += ["-p", name, repr(value) if not isinstance(value, str) else _string_arg(value)]
        env = dict(os.environ)
        if self.device_kind == "cuda":
            argv += ["--gpus", str(len(slot))]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(slot)
        else:
            argv += ["--cpu", "--nproc", str(self.nproc)]
        if self.options.engine:
            argv += ["--engine", self.options.engine]
        for flag, value in (("--timeout", self.options.timeout), ("--collective-timeout", self.options.collective_timeout),
                            ("--idle-timeout", self.options.idle_timeout)):
            if value:
                argv += [flag, str(value)]
        log = open(state.run_dir / "batch.log", "ab")
        try:
            state.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True)
        finally:
            log.close()
        state.slot, state.started, state.status = slot, time.monotonic(), "running"

    def _finish(self, state: RunState) -> None:
        self.free_slots.append(state.slot)
        code = state.process.returncode
        state.status = _status_of(state.run_dir, code)

    def _stop_all(self, running: Sequence[RunState]) -> None:
        """SIGTERM every running run (each stops its ranks and kernel), then SIGKILL stragglers."""
        for state in running:
            _signal_group(state.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while any(s.process.poll() is None for s in running) and time.monotonic() < deadline:
            time.sleep(0.05)
        for state in running:
            if state.process.poll() is None:
                _signal_group(state.process.pid, signal.SIGKILL)
                state.process.wait()
            state.status = _status_of(state.run_dir, state.process.returncode, default="interrupted")


def _string_arg(value: str) -> str:
    """A string value passed so that ``-p`` parsing gives the string back, never a literal."""
    from nbddp.parameters import parse_value

    return value if parse_value(value) == value else repr(value)


def _status_of(run_dir: Path, code: int | None, default: str = "failed") -> str:
    try:
        return json.loads((run_dir / "result.json").read_text(encoding="utf-8"))["status"]
    except (OSError, ValueError, KeyError):
        return "succeeded" if code == 0 else default


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def device_slots(options: BatchOptions, say: Callable[[str], None]) -> tuple[list[tuple[str, ...]], int, str]:
    """``(slots, nproc, kind)``: each slot is the GPU ids one run gets (empty on CPU).

    Raises:
        DeviceError: a run needs more GPUs than are visible.
    """
    gpus = 0 if options.cpu else visible_gpu_count()
    if gpus == 0:
        if options.gpus_per_run:
            raise DeviceError(f"--gpus-per-run {options.gpus_per_run}: no GPU is visible. Use --cpu --nproc N.")
        devices = resolve(cpu=True, nproc=options.nproc)
        if not options.cpu:
            say(f"nbddp: no GPU visible: each run uses {devices.nproc} CPU processes (gloo).")
        parallel = options.parallel or 1
        if parallel < 1:
            raise DeviceError(f"--parallel {parallel}: need at least 1.")
        return [() for _ in range(parallel)], devices.nproc, "cpu"
    per_run = options.gpus_per_run or 1
    if per_run > gpus:
        raise DeviceError(f"--gpus-per-run {per_run} asks for more GPUs than the {gpus} visible.")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in visible.split(",")][:gpus] if visible else [str(i) for i in range(gpus)]
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
    from nbddp.summary import summarize

    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    notebook = read_notebook(options.notebook)
    runs = plan(notebook, load_grid(options.grid), options.parameters)
    slots, nproc, kind = device_slots(options, say)
    out = Path(options.out) if options.out else default_out(options.notebook)
    if options.resume and not out.exists():
        raise NbddpError(f"--resume: {out} does not exist; give the --out of the batch to resume.")
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    say(f"nbddp: batch of {len(runs)} runs, {len(slots)} at a time, in {out}")
    batch = Batch(options, out, runs, slots, nproc, kind, progress)
    try:
        states = batch.run()
    finally:
        rows = summarize(out, [(s.run, s.run_dir, s.status) for s in batch.states])
    failed = [s for s in states if s.status not in ("succeeded", "skipped")]
    return rows, 1 if failed else 0


def batch(notebook: str | Path, grid: Any, *, parameters: dict[str, Any] | None = None, gpus_per_run: int | None = None,
          cpu: bool = False, nproc: int | None = None, parallel: int | None = None, out: str | Path | None = None,
          resume: bool = False, engine: str | None = None, timeout: float | None = None):
    """Run a parameter grid from Python; returns the summary (a pandas DataFrame if pandas is installed)."""
    options = BatchOptions(Path(notebook), grid, dict(parameters or {}), gpus_per_run, cpu, nproc, parallel,
                           Path(out) if out else None, resume, engine, timeout)
    rows, _ = run_batch(options)
    try:
        import pandas
    except ImportError:
        return rows
    return pandas.DataFrame(rows)
