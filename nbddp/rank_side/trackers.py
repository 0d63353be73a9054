"""One experiment record per run: the notebook's own MLflow, TensorBoard and W&B calls, written as their docs
write them (no rank guard), land once, from rank 0, as Lightning's ``rank_zero_only`` and Accelerate's
``main_process_only`` would have them land.

On every other rank (:func:`guard`, called as the rank starts, and for each job of a warm rank):

* **W&B** is disabled: ``wandb.init`` gets ``mode="disabled"`` (its run records nothing, writes no file and sends
  nothing), whatever mode the code asks for;
* **MLflow**'s fluent API (``mlflow.start_run``, ``log_param(s)``, ``log_metric(s)``, ``log_artifact(s)``,
  ``set_tag(s)``, ``set_experiment``, ``autolog``, …) does nothing: no run, no file, no request. A
  ``MlflowClient`` the code builds itself is its own, and is left alone;
* **TensorBoard**'s ``SummaryWriter`` (``torch.utils.tensorboard`` and ``tensorboardX``) writes nothing: no
  folder, no event file.

Modules the rank imported before (a warm rank's kept setup) are patched at once, the others as they are
imported (an import hook that patches each once it has run). Rank 0 is left as it is, but for where it writes:
into the kernel's open records when it has some (:mod:`nbddp.job.trackers` passes them; MLflow and W&B resume
the kernel's run through their own variables, ``MLFLOW_RUN_ID`` and ``WANDB_RUN_ID``; a ``SummaryWriter``
naming no folder of its own writes into the kernel's writer's, ``NBDDP_TENSORBOARD_DIR``).

A tracker that fails where it writes (an MLflow server down, W&B without its key, a folder TensorBoard can't
create) costs one warning line, and that tracker's records of the rest of the job: the training goes on.
MLflow logs asynchronously on rank 0 (unless the code's environment chose), so that its requests never
hold the rank in a step while the others wait for it in a collective (W&B and TensorBoard write from
threads of their own already).

Where the notebook's kernel runs beside the job (``nbddp run``, papermill), it reaches the training cell while the
ranks start: rank 0 then waits, at its first record, for the kernel to say which records it has open
(``kernel_records.json``; at most :data:`KERNEL_RECORDS_WAIT`). Rank 0's records get the run's facts
(``tracking.json``, the job's): a W&B run its parameters and nbddp's facts as config, and in a batch the batch's
group and the grid point's name; a TensorBoard writer in a batch writes into a sub-folder per grid point
(``FOLDER/BATCH/POINT``). The rest is added as the run ends (:mod:`nbddp.job.trackers`).

``NBDDP_TRACK_EVERY_RANK=1`` keeps every rank's records (per-rank system metrics, say), each named by its rank:
a TensorBoard folder ``rank-N`` under the one asked for, an MLflow run of its own tagged ``nbddp.rank`` and named
``… (rank N)``, a W&B run named so. Nothing here imports a tracker: only what the rank's code imports is touched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from nbddp.contracts.atomic import read_json, write_json
from nbddp.contracts.errors import exception_line
from nbddp.contracts.metrics import COUNTERS, step_of
from nbddp.contracts.rank_env import RankEnv
from nbddp.contracts.uris import with_credentials, without_credentials

#: MLflow's fluent calls that create or write a run (each also patched in ``mlflow.tracking.fluent``, where
#: MLflow's own helpers call them).
MLFLOW_CALLS = ("start_run", "end_run", "log_param", "log_params", "log_metric", "log_metrics", "log_artifact",
                "log_artifacts", "log_text", "log_dict", "log_figure", "log_image", "log_table", "log_input",
                "log_inputs", "set_tag", "set_tags", "delete_tag", "set_experiment", "create_experiment",
                "autolog", "set_experiment_tag", "set_experiment_tags", "_get_or_start_run")
#: The modules patched, as each rank starts or as it imports them.
_TARGETS = ("mlflow", "wandb", "torch.utils.tensorboard", "tensorboardX")

_how: tuple[int, bool, Path | None] | None = None
"""This process's rank, whether every rank keeps its records, and the kernel's TensorBoard folder."""
_failed: set[str] = set()
"""The trackers that failed in this job (said once): their calls do nothing until the next job."""
_remembered: dict[str, dict[str, Any]] = {}
"""What rank 0 noted in ``trackers.json`` in this job (MLflow asks for its run at every logged metric)."""
_writers: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""This rank's TensorBoard writers (their last events flushed when a stop comes)."""
_axes: set[str] = set()
"""The W&B runs whose ``nbddp/*`` metrics have their own x axis already."""
_noted = 0
"""``nbddp.log`` records of this job so far."""
_tracking: dict[str, Any] | None = None
"""``tracking.json`` (the run's facts for its records), read by rank 0 at its first record in this job."""
#: How long rank 0 waits, at its first record, for the notebook's kernel to reach the training cell and say which
#: records it has open (``nbddp run``, papermill: the kernel runs the cells before the training as the ranks start);
#: half of ``--collective-timeout`` where that is shorter (the other ranks may wait for rank 0 in a collective).
KERNEL_RECORDS_WAIT = 120.0
#: MLflow's calls that give a run (``_get_or_start_run``: what every ``log_*`` without a run calls).
_RUN_STARTERS = ("start_run", "_get_or_start_run")


def guard(rank: int, environ: RankEnv | None = None) -> None:
    """Make this rank's tracker calls land as :mod:`this module <nbddp.rank_side.trackers>` says: now for the
    modules already imported, on import for the others. Idempotent (a warm rank calls it for every job)."""
    global _how, _tracking, _noted
    env = RankEnv.from_environ() if environ is None else environ
    _how = (rank, env.track_every_rank, env.tensorboard_dir)
    _tracking, _noted = None, 0
    _axes.clear()
    _failed.clear()
    _remembered.clear()
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "true")
    os.environ.pop("WANDB_SERVICE", None)  # never the kernel's wandb-core (it holds the kernel's run): one of its own
    if rank != 0:
        if env.track_every_rank:
            for variable in ("MLFLOW_RUN_ID", "WANDB_RUN_ID", "WANDB_RESUME"):  # a record of its own, not rank 0's
                os.environ.pop(variable, None)
        else:
            os.environ["WANDB_MODE"] = "disabled"
            os.environ["WANDB_SILENT"] = "true"
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    for name in _TARGETS:
        if name in sys.modules:
            _patch(name, sys.modules[name])


def silent(tracker: str = "") -> bool:
    """Whether this rank's tracker calls are dropped: a rank other than 0 (unless every rank keeps its own),
    or ``tracker`` failed in this job."""
    return (_how is not None and _how[0] != 0 and not _how[1]) or tracker in _failed


def _fail(tracker: str, exc: BaseException) -> None:
    """Say once that ``tracker`` failed, and drop its calls for the rest of the job."""
    if tracker not in _failed:
        _failed.add(tracker)
        print(f"[nbddp] warning: {tracker} failed ({exception_line(exc)}); this run's {tracker} records "
              "stop here, the training goes on", file=sys.stderr, flush=True)


def _attempt(tracker: str, call: Callable[[], Any], instead: Callable[[], Any]) -> Any:
    """``call()``; should ``tracker`` fail there (its store, its network, its folder), say so once and give
    ``instead()``. The code's own mistakes (a ``TypeError``) and interrupts go on as they are."""
    try:
        return call()
    except (TypeError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - never the run's end
        _fail(tracker, exc)
        return instead()


def facts() -> dict[str, Any]:
    """Rank 0's: the run's facts for its records (``tracking.json``: ``parameters``, ``tags``, ``group``,
    ``name``), read at its first record, after taking the kernel's open records when it has some to give."""
    global _tracking
    if _tracking is not None:
        return _tracking
    _tracking = {}
    directory = RankEnv.from_environ().run_dir
    if directory is None or _how is None or _how[0] != 0:
        return _tracking
    _tracking = read_json(directory.tracking) or {}
    if _tracking.get("kernel_records"):
        _take_kernel_records(directory)
    return _tracking


def _take_kernel_records(directory: Any) -> None:
    """Wait for the notebook's kernel to reach the training cell, then write into the records it has open: its
    MLflow and W&B runs (their own variables), its TensorBoard folder."""
    global _how
    collective = RankEnv.from_environ().collective_timeout  # (the other ranks may wait in one meanwhile)
    wait = min(KERNEL_RECORDS_WAIT, collective / 2) if collective else KERNEL_RECORDS_WAIT
    deadline = time.monotonic() + wait
    while not directory.kernel_records.exists():
        if time.monotonic() > deadline:
            print(f"[nbddp] warning: the notebook's kernel did not reach the training cell within "
                  f"{wait:g} s: rank 0's experiment records are its own, not the kernel's open ones",
                  file=sys.stderr, flush=True)
            return
        time.sleep(0.05)
    given = read_json(directory.kernel_records) or {}
    variables = given.get("variables") or {}
    for name, value in variables.items():
        if name.startswith(("MLFLOW_", "WANDB_")):  # (a store's address comes without its credentials: ours)
            os.environ[name] = with_credentials(str(value), name) if name.endswith("_URI") else str(value)
    folder = RankEnv.from_environ(variables).tensorboard_dir
    if folder is not None and _how is not None:
        _how = (_how[0], _how[1], folder)
    if given.get("names"):
        print(f"[nbddp] rank 0 adds this run's points to the kernel's open {', '.join(given['names'])}", flush=True)


def _remember(tracker: str, facts: dict[str, Any]) -> None:
    """Rank 0 notes the record it writes, in the run dir (for the kernel side to add how the run ended): once
    per record, not at every call that asks for it."""
    directory = RankEnv.from_environ().run_dir
    if directory is None or _remembered.get(tracker) == facts:
        return
    _remembered[tracker] = facts
    try:
        write_json(directory.tracker_runs, {**(read_json(directory.tracker_runs) or {}), tracker: facts})
    except OSError:
        pass


def end_job(failed: bool, interrupted: bool = False) -> None:
    """A warm rank's job is over: end the runs it left open, as a fresh rank's exit does (MLflow's and W&B's
    ``atexit``), so that the next job starts its own, or resumes the kernel's as it is then. The kernel's
    interrupt (a failed peer stops the others) waits until they are ended: it would drop the points still
    queued (MLflow logs asynchronously, W&B through its service)."""
    import signal
    import threading

    held = threading.current_thread() is threading.main_thread()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if held else None
    try:
        _end_runs(failed, interrupted)
    finally:
        if before is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _ends_them_when_stopped() -> None:
    """A rank with a record open ends it when a stop's SIGTERM comes (a peer failed, ``--timeout``, ``nbddp kill``):
    Python's own SIGTERM ends the process with no ``atexit``, and W&B's queued points and its run's end, MLflow's
    queue and a writer's last events were lost with it. Where SIGTERM had Python's default, the handler ends them
    (MLflow ``KILLED``, W&B exit code 1), then lets the signal end the process as before. A handler of the code's
    or a library's (Lightning saves at its next step, then exits: ``atexit`` ends the runs) stays in charge, and
    an ignored SIGTERM stays ignored. Once per process; not in a process forked from it (a DataLoader's worker);
    a warm rank's jobs end theirs themselves (:func:`end_job`). Should the ending hang (a lock the interrupted
    main thread held), the stop's SIGKILL still comes after its grace."""
    import signal
    import threading

    previous = signal.getsignal(signal.SIGTERM)
    if (previous not in (signal.SIG_DFL, None) or RankEnv.from_environ().warm
            or threading.current_thread() is not threading.main_thread()):
        return
    owner = os.getpid()

    def stopped(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if os.getpid() == owner:
            try:
                for writer in list(_writers):
                    writer.flush()
                _end_runs(failed=True, interrupted=True)
            except Exception:  # noqa: BLE001 - the stop goes on whatever the trackers do
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, stopped)


def _end_runs(failed: bool, interrupted: bool) -> None:
    mlflow = sys.modules.get("mlflow")
    try:
        end = getattr(mlflow.end_run, "__wrapped__", mlflow.end_run) if mlflow is not None else None
        for _ in range(16):  # (runs nested in runs; the real end_run: the patched one drops calls after a failure)
            if end is None or mlflow.active_run() is None:
                break
            end("KILLED" if interrupted else "FAILED" if failed else "FINISHED")
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is not None and hasattr(fluent, "_active_experiment_id"):  # set_experiment's choice: the job's
            fluent._active_experiment_id = None
    except Exception as exc:  # noqa: BLE001 - the store gone meanwhile: nothing to end it in
        _fail("MLflow", exc)
    wandb = sys.modules.get("wandb")
    try:
        if wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.run.finish(exit_code=1 if failed or interrupted else 0)
        if wandb is not None and hasattr(wandb, "teardown"):  # its settings, read from the job's environment once
            wandb.teardown()
    except Exception as exc:  # noqa: BLE001 - a tracker's failure never costs the run: said, then past
        _fail("W&B", exc)


# ---------------------------------------------------------------- patching, once per module


def _patch(name: str, module: Any) -> None:
    if getattr(module, "_nbddp_patched", False):
        return
    try:
        {"mlflow": _patch_mlflow, "wandb": _patch_wandb, "torch.utils.tensorboard": _patch_tensorboard,
         "tensorboardX": _patch_tensorboard}[name](module)
        module._nbddp_patched = True
    except Exception as exc:  # noqa: BLE001 - a tracker's new version must never cost a run
        print(f"[nbddp] warning: could not keep {name}'s records to one rank ({type(exc).__name__}: {exc}); "
              "every rank writes its own", file=sys.stderr, flush=True)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a tracker's module the moment its own code has run (before the rank's code sees it)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
            if spec is not None:
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str) -> None:
        self.loader, self.name = loader, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _patch(self.name, module)

    def __getattr__(self, attribute: str) -> Any:  # get_resource_reader, is_package, …: the real loader's
        return getattr(self.loader, attribute)


# ---------------------------------------------------------------- MLflow


class _NoRun:
    """What ``mlflow.start_run`` gives a silent rank: usable as the real one is (``with``, ``.info.run_id``)."""

    class info:  # noqa: N801 - mirrors mlflow.entities.RunInfo's attribute access
        run_id = run_name = experiment_id = artifact_uri = ""
        status = "RUNNING"

    data = None

    def __enter__(self) -> "_NoRun":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _patch_mlflow(mlflow: Any) -> None:
    import mlflow.tracking.fluent as fluent

    for name in MLFLOW_CALLS:
        for owner in (mlflow, fluent):
            original = getattr(owner, name, None)
            if callable(original):
                setattr(owner, name, _mlflow_call(name, original))


def _mlflow_call(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    gives_a_run = name in _RUN_STARTERS

    def call(*args: Any, **kwargs: Any) -> Any:
        nothing = _NoRun if gives_a_run else (lambda: None)
        if silent("MLflow"):
            return nothing()
        if _how is not None and _how[0] == 0:
            facts()  # (first: the kernel's open run, when it has one to give)
        if name == "start_run" and _how is not None and _how[0] != 0:  # every rank keeps its own: named by rank
            kwargs["run_name"] = f"{kwargs.get('run_name') or 'nbddp'} (rank {_how[0]})"
            kwargs["tags"] = {**(kwargs.get("tags") or {}), "nbddp.rank": str(_how[0])}
        elif name == "start_run" and _starts_a_new_run(args, kwargs):
            kwargs["run_name"] = _new_run_name()
        answer = _attempt("MLflow", lambda: original(*args, **kwargs), nothing)
        if gives_a_run and not isinstance(answer, _NoRun):
            _ends_them_when_stopped()
        if gives_a_run and not isinstance(answer, _NoRun) and _how is not None and _how[0] == 0:
            _remember("mlflow", {"run_id": answer.info.run_id,  # (the store's address: never its credentials)
                                 "tracking_uri": without_credentials(str(sys.modules["mlflow"].get_tracking_uri()))})
        return answer

    call.__wrapped__ = original  # type: ignore[attr-defined]
    call.__name__ = name
    return call


def _starts_a_new_run(args: tuple, kwargs: dict[str, Any]) -> bool:
    """``mlflow.start_run(...)`` that starts an unnamed run (not one it resumes: a run id given, or MLflow's own
    variable, which names the kernel's run where rank 0 adds to it)."""
    return not args and not kwargs.get("run_id") and not kwargs.get("run_name") and not os.environ.get("MLFLOW_RUN_ID")


def _new_run_name() -> str:
    """MLflow's own kind of name (``kindly-hare-713``), drawn with :mod:`random` seeded afresh from the system, its
    state put back after: MLflow draws it from :mod:`random`, whose state a warm rank puts back before each job (the
    code draws what a fresh run draws), so every warm run would have had the same name."""
    import random

    state = random.getstate()
    random.seed()
    try:
        from mlflow.utils.name_utils import _generate_random_name

        return _generate_random_name()
    except (ImportError, AttributeError, TypeError):  # (MLflow's private helper: another version's may differ)
        return f"nbddp-{random.getrandbits(32):08x}"
    finally:
        random.setstate(state)


# ---------------------------------------------------------------- W&B


def _patch_wandb(wandb: Any) -> None:
    original = wandb.init

    def init(*args: Any, **kwargs: Any) -> Any:
        given: dict[str, Any] = {}
        if silent("W&B"):
            kwargs["mode"] = "disabled"
        elif _how is not None and _how[0] != 0:
            kwargs["name"] = f"{kwargs.get('name') or 'nbddp'} (rank {_how[0]})"
        elif _how is not None:
            given = facts()
            if given.get("group") and not kwargs.get("group") and "WANDB_RUN_GROUP" not in os.environ:
                kwargs["group"] = given["group"]  # a batch: its grid points side by side in W&B's compare view
                if not kwargs.get("name") and "WANDB_NAME" not in os.environ:
                    kwargs["name"] = given.get("name")
        run = _attempt("W&B", lambda: original(*args, **kwargs),  # (no key, no network, a refused project)
                       lambda: original(*args, **{**kwargs, "mode": "disabled"}))
        if getattr(run, "id", None) and not getattr(run, "disabled", False):
            _ends_them_when_stopped()
            if given:
                _attempt("W&B", lambda: _wandb_facts(run, given), lambda: None)
        return run

    init.__wrapped__ = original  # type: ignore[attr-defined]
    wandb.init = init


def note_metrics(record: dict[str, Any]) -> None:
    """Rank 0's ``nbddp.log`` record, into the code's open W&B run too: ``nbddp/KEY`` beside
    ``nbddp/step``, their own x axis. They join the code's current W&B step (``commit=False``), so the code's own
    ``wandb.log`` steps stay as it counts them; a key logged twice before the code's next ``wandb.log`` keeps its
    last value there (``metrics.jsonl``, MLflow and TensorBoard keep every one)."""
    global _noted
    index, _noted = _noted, _noted + 1  # (its place, the step of a record with no step or epoch of its own)
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None or _how is None or _how[0] != 0 or silent("W&B") or getattr(run, "disabled", False):
        return
    values = {f"nbddp/{key}": value for key, value in record.items()
              if key not in COUNTERS and isinstance(value, (int, float)) and not isinstance(value, bool)}
    if not values:
        return

    def log() -> None:
        if run.id not in _axes:
            run.define_metric("nbddp/*", step_metric="nbddp/step")
            _axes.add(run.id)
        run.log({**values, "nbddp/step": step_of(record, index)}, commit=False)

    _attempt("W&B", log, lambda: None)


def _wandb_facts(run: Any, given: dict[str, Any]) -> None:
    """Rank 0's W&B run: the run's parameters and nbddp's facts in its config; its id noted for the ending."""
    run.config.update({**(given.get("parameters") or {}), "nbddp": given.get("tags") or {}}, allow_val_change=True)
    _remember("wandb", {"run_id": run.id, "project": run.project or "", "entity": run.entity or "",
                        "mode": str(getattr(run.settings, "mode", "") or "")})


# ---------------------------------------------------------------- TensorBoard


class _NoWriter:
    """A ``SummaryWriter`` that writes nothing: every method accepted, none does anything."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.log_dir = self.logdir = ""

    def get_logdir(self) -> str:
        return ""

    def __enter__(self) -> "_NoWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _patch_tensorboard(module: Any) -> None:
    folder_parameter = "logdir" if module.__name__ == "tensorboardX" else "log_dir"
    original = module.SummaryWriter

    class SummaryWriter(original):  # type: ignore[misc, valid-type]
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            if silent("TensorBoard"):
                return _NoWriter()
            writer = super().__new__(cls)

            def made() -> bool:
                writer.__init__(*args, **kwargs)
                return True

            if not _attempt("TensorBoard", made, lambda: False):  # (a folder it can't create or write)
                return _NoWriter()
            writer._nbddp_ready = True
            return writer

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if getattr(self, "_nbddp_ready", False):  # (made in __new__, where a failure can still give a no-op)
                return
            folder = args[0] if args else kwargs.pop(folder_parameter, None)
            rank, every, _ = _how if _how is not None else (0, False, None)
            given = facts() if _how is not None and rank == 0 else {}
            if folder is None and rank == 0 and _how is not None and _how[2] is not None:
                folder = str(_how[2])  # (the kernel's, possibly just taken by facts())
            if given.get("group"):  # a batch: a sub-folder per grid point, side by side in TensorBoard
                folder = os.path.join(str(folder or "runs"), str(given["group"]), str(given.get("name") or ""))
            if rank != 0 and every:
                if folder is None:
                    kwargs["comment"] = f"{kwargs.get('comment', '')}-rank{rank}"
                else:
                    folder = os.path.join(str(folder), f"rank-{rank}")
            if folder is not None:  # (tensorboardX checks, then creates it: ranks creating one folder race there)
                os.makedirs(folder, exist_ok=True)
            super().__init__(folder, *args[1:], **kwargs)
            _writers.add(self)
            _ends_them_when_stopped()
            if rank == 0 and _how is not None:
                written = getattr(self, "log_dir", None) or getattr(self, "logdir", None)
                folders = (_remembered.get("tensorboard") or {}).get("folders", [])
                if written and os.path.abspath(written) not in folders:
                    _remember("tensorboard", {"folders": [*folders, os.path.abspath(written)]})

    SummaryWriter.__name__ = SummaryWriter.__qualname__ = "SummaryWriter"
    SummaryWriter.__module__ = original.__module__
    module.SummaryWriter = SummaryWriter
    writer = sys.modules.get(f"{module.__name__}.writer")
    if writer is not None and getattr(writer, "SummaryWriter", None) is original:
        writer.SummaryWriter = SummaryWriter
