"""The job's side of one experiment record per run (:mod:`nbddp.rank_side.trackers` is the ranks'): what every
record of the run gets, the records the kernel has open for rank 0 to write into, and what nbddp adds as the run
ends.

**Before the ranks start** (:func:`start_tracking`, ``tracking.json``): the run's parameters, nbddp's facts (world
size, devices, engine, torch, the notebook, a digest of the script), the trackers asked for (``--track``,
``NBDDP_TRACK``), and in a batch its group and the grid point's name. **The kernel's open records**, so that a cell
after the training can log the CPU evaluation into the same record:

* an **MLflow** run (``mlflow.active_run()``): rank 0's ``mlflow.start_run()`` resumes it (MLflow's own
  ``MLFLOW_RUN_ID``, with its tracking URI and experiment);
* a **W&B** run (``wandb.run``): rank 0's ``wandb.init()`` resumes it (``WANDB_RUN_ID``, ``WANDB_RESUME=allow``, its
  project, mode and folder);
* a **TensorBoard** writer left open (``torch.utils.tensorboard`` or ``tensorboardX``): rank 0's writer that names
  no folder of its own writes into its folder.

``%%ddp_train`` passes them in the ranks' environment; ``nbddp run`` and papermill, whose kernel reaches the
training cell while the ranks start, in ``kernel_records.json`` (:func:`share_open_records`, run in that kernel).
Each run of the cell writes into the same open record: its points come after the ones already there (a
re-run's steps start again at its own first step, later in time).

**As the run ends** (:func:`record_ending`): an **MLflow** run (rank 0's, the kernel's, or, asked for, one of
nbddp's own) gets the parameters, nbddp's facts as tags, every ``nbddp.log`` metric the code didn't log itself
(with its step), ``result.json``, the output notebook and the weights (up to :data:`WEIGHTS_ARTIFACT_BYTES`) as
artifacts, and a failed run's status and error line. A **TensorBoard** folder (rank 0's, the kernel's, or,
asked for, the run dir itself: ``tensorboard --logdir runs`` shows every run, ``--logdir OUT`` a batch's) gets
the same as a text summary ``nbddp`` and scalars ``nbddp/KEY``. **W&B**, asked for where the code has no W&B
run, gets a run of nbddp's own with all of it; the code's own W&B run got the parameters and nbddp's facts as
its config and the ``nbddp.log`` metrics from rank 0 as it ran, and W&B's exit code marks it failed. A batch's
MLflow runs are grouped under a parent run (:func:`group_batch`).

Nothing here imports a tracker but the one a record is in: only one the kernel has imported is asked.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbddp.contracts.atomic import read_json, write_json
from nbddp.contracts.errors import exception_line
from nbddp.contracts.rank_env import RankEnv
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.uris import with_credentials, without_credentials
from nbddp.contracts.interpreter import code_argv

if TYPE_CHECKING:
    from nbddp.plan.job_spec import JobSpec

#: The largest ``weights.pt`` added to a run's MLflow record as an artifact (a larger one is named by a tag).
WEIGHTS_ARTIFACT_BYTES = 100_000_000
#: Variables of the trackers' own that may carry a record to rank 0, and none other (nothing secret: no key,
#: no token; what the kernel's tracker holds besides stays there).
RECORD_VARIABLES = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "WANDB_RUN_ID", "WANDB_RESUME",
                    "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE", "WANDB_DIR")
#: A batch's run: the batch's folder (``nbddp batch`` sets it for each of its ``nbddp run`` processes).
BATCH_VARIABLE = "NBDDP_BATCH"
#: How long nbddp's own W&B record may take to be written (W&B's service starts in that process).
WANDB_SECONDS = 120


def start_tracking(spec: "JobSpec", parameters: dict[str, Any], notebook: str, asked: tuple[str, ...],
                   kernel_records: dict[str, str], later: bool, torch_version: str, tracked: bool = True) -> None:
    """``tracking.json``, before the ranks start: what every record of the run gets. ``kernel_records``: the
    kernel's open records (``%%ddp_train``); ``later``: the kernel will say at its training cell
    (:func:`share_open_records`), and rank 0 waits for it at its first record; ``tracked=False``: a run that is
    no experiment's (``%%ddp_exec``), to which nbddp adds nothing."""
    batch = os.environ.get(BATCH_VARIABLE, "")
    tags = {"nbddp.notebook": notebook, "nbddp.engine": spec.script.engine, "nbddp.world_size": str(spec.world_size),
            "nbddp.devices": f"{spec.devices.nproc} × {spec.devices.kind}", "nbddp.run_dir": str(spec.run_dir.path),
            "nbddp.torch": torch_version,
            "nbddp.script_sha256": hashlib.sha256(spec.script.text.encode()).hexdigest()[:16]}
    write_json(spec.run_dir.tracking, {
        "asked": list(asked), "parameters": _plain(parameters), "tags": tags, "cwd": str(spec.cwd),
        "name": spec.run_dir.path.name, "group": Path(batch).name if batch else "",
        "kernel": public(kernel_records), "kernel_records": later, "tracked": tracked})


def public(variables: dict[str, str]) -> dict[str, str]:
    """Record variables as a run dir may hold them: a store's address without its credentials."""
    return {name: without_credentials(value) if name.endswith("_URI") else value for name, value in variables.items()}


def own_credentials(variables: dict[str, str]) -> dict[str, str]:
    """:func:`public`'s variables with a store's credentials back, from this process's own environment."""
    return {name: with_credentials(value, name) if name.endswith("_URI") else value
            for name, value in variables.items()}


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """Values as JSON holds them (a tuple as a list; what JSON can't hold, as its repr)."""
    return json.loads(json.dumps(values, default=repr))


def share_open_records(path: str) -> None:
    """Run in the notebook's kernel at its training cell (``nbddp run``, papermill): write the records it has
    open (:func:`open_records`) to ``path`` (``kernel_records.json``), for rank 0. Never raises: a kernel whose
    trackers can't be read shares none."""
    try:
        variables, names = open_records()
    except Exception:  # noqa: BLE001 - a kernel whose trackers can't be read shares none
        variables, names = {}, []
    write_json(Path(path), {"variables": public(variables), "names": names})


def kernel_may_open_records(sources: list[str]) -> bool:
    """Whether the kernel's cells before the training (their ``sources``) may open a record for rank 0 to write
    into: they name a tracker. Else rank 0 never waits for the kernel."""
    return any(word in source for source in sources for word in ("mlflow", "wandb", "SummaryWriter"))


def open_records() -> tuple[dict[str, str], list[str]]:
    """``(variables for the ranks, what each names)``: the records this process (the kernel) has open."""
    found: dict[str, str] = {}
    said: list[str] = []
    for reader in (_mlflow, _wandb, _tensorboard):
        try:
            variables, name = reader()
        except Exception:  # noqa: BLE001 - a tracker's odd state never costs a run: its record is just not shared
            continue
        if variables:
            found |= {k: v for k, v in variables.items() if k in RECORD_VARIABLES or k.startswith("NBDDP_")}
            said.append(name)
    return found, said


def rank_variables(kernel_records: dict[str, str] | None = None) -> dict[str, str]:
    """The variables a job's ranks get for their records: the kernel's open ones and, when this process was
    asked (``NBDDP_TRACK_EVERY_RANK=1``), every rank keeping its own."""
    every = RankEnv.from_environ().track_every_rank
    return {**(kernel_records or {}), **RankEnv(track_every_rank=every).variables()}


def start_line(names: list[str]) -> str:
    """The start line's word on where rank 0's records go (``""``: the kernel has none open)."""
    if not names:
        return ""
    return f"rank 0 adds this run's points to the kernel's open {', '.join(names)}; the other ranks write none"


def _mlflow() -> tuple[dict[str, str], str]:
    mlflow = sys.modules.get("mlflow")
    run = mlflow.active_run() if mlflow is not None else None
    if run is None:
        return {}, ""
    info = run.info
    return ({"MLFLOW_RUN_ID": info.run_id, "MLFLOW_EXPERIMENT_ID": str(info.experiment_id),
             "MLFLOW_TRACKING_URI": str(mlflow.get_tracking_uri())},
            f"MLflow run {info.run_name or info.run_id!r}")


def _wandb() -> tuple[dict[str, str], str]:
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:
        return {}, ""
    settings: Any = run.settings
    found = {"WANDB_RUN_ID": run.id, "WANDB_RESUME": "allow", "WANDB_PROJECT": run.project or "",
             "WANDB_ENTITY": run.entity or "", "WANDB_MODE": str(settings.mode or ""),
             "WANDB_DIR": str(settings.root_dir or "")}
    # (rank 0 resumes it in a wandb-core service of its own: the kernel's holds the run and refuses it to
    # another process, "run ID is in use"; nbddp.rank_side.trackers drops the inherited WANDB_SERVICE)
    return {k: v for k, v in found.items() if v}, f"W&B run {run.name or run.id!r}"


def _tensorboard() -> tuple[dict[str, str], str]:
    classes = tuple(module.SummaryWriter for name in ("torch.utils.tensorboard", "tensorboardX")
                    if (module := sys.modules.get(name)) is not None and hasattr(module, "SummaryWriter"))
    if not classes:
        return {}, ""
    writers = [o for o in gc.get_objects() if issubclass(type(o), classes) and _open(o)]  # (type(): no proxy's
    # __class__ is asked, which warns for some of torch's deprecated names)
    if not writers:
        return {}, ""
    folder = str(writers[-1].get_logdir() if hasattr(writers[-1], "get_logdir") else writers[-1].logdir)
    return RankEnv(tensorboard_dir=folder).variables(), f"TensorBoard folder {folder}"


def _open(writer: Any) -> bool:
    """A writer not closed yet (torch's drops its file writers when closed; tensorboardX's its file writer)."""
    if hasattr(writer, "all_writers"):
        return writer.all_writers is not None
    return getattr(writer, "file_writer", None) is not None


def record_ending(paths: RunDir, record: Any, error: str = "") -> list[str]:
    """Add how the run ended to its records (see the module's docstring): the MLflow run, the TensorBoard
    folders and, asked for, a W&B run of nbddp's own.

    Returns warning lines (a store that can't be reached, weights over the cap): the run's own ending stands.
    """
    tracking = read_json(paths.tracking) or {}
    if tracking.get("tracked") is False:
        return []
    written = read_json(paths.tracker_runs) or {}
    kernel = {**(tracking.get("kernel") or {}), **((read_json(paths.kernel_records) or {}).get("variables") or {})}
    asked = tracking.get("asked") or []
    tags = {**(tracking.get("tags") or {}), "nbddp.status": str(record.status), "nbddp.run_dir": str(paths.path)}
    if error:
        tags["nbddp.error"] = error[:5000]
    if paths.weights.exists():
        tags["nbddp.weights"] = str(paths.weights)
    parameters = {**record.parameters, **(tracking.get("parameters") or {})}
    said: list[str] = []
    for tracker, add in (("MLflow", _mlflow_ending), ("TensorBoard", _tensorboard_ending), ("W&B", _wandb_ending)):
        try:
            said += add(paths, record, tracking, written, kernel, asked, tags, parameters)
        except Exception as exc:  # noqa: BLE001 - the store gone since: the run's record (result.json) stands
            said.append(f"warning: {tracker}: how the run ended could not be added to its record "
                        f"({exception_line(exc)})")
    return said


def _failed_status(record: Any) -> str:
    from nbddp.contracts.status import Status

    return {Status.SUCCEEDED: "FINISHED", Status.INTERRUPTED: "KILLED"}.get(Status(record.status), "FAILED")


def _nbddp_metrics(paths: RunDir) -> list[tuple[str, float, int, float]]:
    """Every numeric ``nbddp.log`` value: ``(key, value, step, time)``, in order."""
    from nbddp.contracts.metrics import COUNTERS, read_metrics, step_of

    return [(key, float(value), step_of(point, index), float(point.get("time", 0)))
            for index, point in enumerate(read_metrics(paths))
            for key, value in point.items()
            if key not in COUNTERS and isinstance(value, (int, float)) and not isinstance(value, bool)]


def _artifacts(paths: RunDir, tracker: str) -> tuple[list[Path], list[str]]:
    """The files a record gets (``result.json``, the output notebook, the weights up to the cap) and what is
    said of weights over it."""
    from nbddp.contracts.rank_memory import size as human

    files = [path for path in (paths.result, paths.output) if path.exists()]
    said = []
    if paths.weights.exists():
        size = paths.weights.stat().st_size
        if size <= WEIGHTS_ARTIFACT_BYTES:
            files.append(paths.weights)
        else:
            said.append(f"{tracker}: {paths.weights} ({human(size)}) is over the {human(WEIGHTS_ARTIFACT_BYTES)} a "
                        "record takes: its path is the record's nbddp.weights, not a copy")
    return files, said


def _mlflow_ending(paths: RunDir, record: Any, tracking: dict[str, Any], written: dict[str, Any],
                   kernel: dict[str, str], asked: list[str], tags: dict[str, str],
                   parameters: dict[str, Any]) -> list[str]:
    target = written.get("mlflow")
    if not isinstance(target, dict) and kernel.get("MLFLOW_RUN_ID"):  # the kernel's, which the code didn't write
        target = {"run_id": kernel["MLFLOW_RUN_ID"], "tracking_uri": kernel.get("MLFLOW_TRACKING_URI", "")}
    if not isinstance(target, dict) and "mlflow" not in asked:
        return []
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient, get_tracking_uri

    ours = not isinstance(target, dict)
    if ours:  # asked for, and no run of the code's or the kernel's: one of nbddp's own
        client = MlflowClient()
        run_id = client.create_run(_mlflow_experiment(client), run_name=str(tracking.get("name") or paths.path.name),
                                   tags={"mlflow.source.name": str(tags.get("nbddp.notebook", ""))}).info.run_id
        target = {"run_id": run_id, "tracking_uri": without_credentials(str(get_tracking_uri()))}
        write_json(paths.tracker_runs, {**written, "mlflow": target})  # (the batch groups it with the others)
    client = MlflowClient(with_credentials(target.get("tracking_uri") or "") or None)
    run_id = target["run_id"]
    data = client.get_run(run_id).data
    params = [Param(str(k), str(v)[:6000]) for k, v in parameters.items() if str(k) not in data.params]
    metrics = [Metric(key, value, int(time * 1000), step) for key, value, step, time in _nbddp_metrics(paths)
               if key not in data.metrics]
    for start in range(0, len(metrics), 1000):  # (MLflow takes at most 1000 metrics a batch)
        client.log_batch(run_id, metrics=metrics[start:start + 1000])
    files, said = _artifacts(paths, "MLflow")
    for start in range(0, len(params), 100):  # (MLflow takes at most 100 parameters a batch)
        client.log_batch(run_id, params=params[start:start + 100])
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    for path in files:
        client.log_artifact(run_id, str(path), "nbddp")
    if ours or _failed_status(record) != "FINISHED":
        client.set_terminated(run_id, _failed_status(record))
    return said


def _mlflow_experiment(client: Any) -> str:
    """Where a run of nbddp's own goes: MLflow's own variables say (``MLFLOW_EXPERIMENT_ID``, ``…_NAME``), else its
    default experiment."""
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return "0"
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment is not None else client.create_experiment(name)


def _tensorboard_ending(paths: RunDir, record: Any, tracking: dict[str, Any], written: dict[str, Any],
                        kernel: dict[str, str], asked: list[str], tags: dict[str, str],
                        parameters: dict[str, Any]) -> list[str]:
    folders = list((written.get("tensorboard") or {}).get("folders") or [])
    kernels = RankEnv.from_environ(kernel).tensorboard_dir
    if not folders and kernels is not None:
        folders = [str(kernels)]
    if not folders and "tensorboard" in asked:  # the run dir: tensorboard --logdir runs (a batch's: its --out)
        folders = [str(paths.path)]
    if not folders:
        return []
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter  # (tensorboard's own writer needs torch)
        except ImportError:
            return ["warning: TensorBoard: nbddp writes its record with tensorboardX or torch's SummaryWriter, and "
                    "neither can be imported here (pip install tensorboardX)"]
    facts = {**{f"param.{k}": v for k, v in parameters.items()}, **tags}
    table = "| | |\n|---|---|\n" + "\n".join(f"| {k} | {str(v).replace('|', '/')} |" for k, v in facts.items())
    for folder in folders:
        writer = SummaryWriter(folder, filename_suffix=".nbddp")
        try:
            writer.add_text("nbddp", table, 0)
            for key, value, step, time in _nbddp_metrics(paths):
                writer.add_scalar(f"nbddp/{key}", value, step, walltime=time or None)
        finally:
            writer.close()
    return []


#: nbddp's own W&B run, written by a process of its own (W&B's service and its run state stay out of this one).
_WANDB_RECORD = """import json, sys
import wandb
given = json.load(sys.stdin)
run = wandb.init(project=given["project"], name=given["name"], group=given["group"] or None, job_type="nbddp",
                 config=given["config"], tags=["nbddp"])
for step, values in given["points"]:
    run.log(values, step=step)
run.summary.update(given["summary"])
if given["files"]:
    artifact = wandb.Artifact(given["artifact"], type="nbddp-run")
    for path in given["files"]:
        artifact.add_file(path)
    run.log_artifact(artifact)
run.finish(exit_code=given["exit_code"])
"""


def _wandb_ending(paths: RunDir, record: Any, tracking: dict[str, Any], written: dict[str, Any],
                  kernel: dict[str, str], asked: list[str], tags: dict[str, str],
                  parameters: dict[str, Any]) -> list[str]:
    config = {**parameters, "nbddp": tags}
    summary = {k: v for k, v in tags.items() if k in ("nbddp.status", "nbddp.error")}
    ranks = written.get("wandb") if isinstance(written.get("wandb"), dict) else None
    wandb = sys.modules.get("wandb")
    here = getattr(wandb, "run", None) if wandb is not None else None
    if here is not None and here.id in ((ranks or {}).get("run_id"), kernel.get("WANDB_RUN_ID")):
        here.config.update(config, allow_val_change=True)  # the kernel's own run, open in this process
        here.summary.update(summary)
        return []
    if ranks is not None:  # the code's run: its config and points came from rank 0; a failure's line comes now
        if str(record.status) == "succeeded" or ranks.get("run_id") == kernel.get("WANDB_RUN_ID"):
            return []  # (the kernel's run, which its kernel holds until it finishes it: not resumed from here)
        given = {"run": ranks, "summary": summary}
        return _wandb_process(_WANDB_FAILED, given, tracking, "nbddp's error line could not be added to the run")
    if "wandb" not in asked:
        return []
    files, said = _artifacts(paths, "W&B")
    given = {"project": os.environ.get("WANDB_PROJECT") or "nbddp",
             "name": str(tracking.get("name") or paths.path.name), "group": str(tracking.get("group") or ""),
             "config": config, "points": _by_step(paths), "summary": summary,
             "files": [str(f) for f in files], "artifact": f"nbddp-{paths.path.name}"[:120],
             "exit_code": 0 if str(record.status) == "succeeded" else 1}
    return said + _wandb_process(_WANDB_RECORD, given, tracking, "nbddp's record of the run could not be written")


#: A failed run's W&B run (the code's, rank 0's): resumed to take nbddp's error line, and marked failed.
_WANDB_FAILED = """import json, sys
import wandb
given = json.load(sys.stdin)
noted = given["run"]
run = wandb.init(id=noted["run_id"], project=noted["project"] or None, entity=noted["entity"] or None,
                 mode=noted["mode"] or None, resume="allow")
run.summary.update(given["summary"])
run.finish(exit_code=1)
"""


def _wandb_process(code: str, given: dict[str, Any], tracking: dict[str, Any], failure: str) -> list[str]:
    """Run ``code`` (W&B's client, given ``given`` on its stdin) in a process of its own: W&B's service and its
    run state stay out of this one (a kernel's own run, its settings)."""
    environ = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}  # (never the kernel's service)
    done = subprocess.run(code_argv(code), input=json.dumps(given, default=str), text=True,
                          capture_output=True, timeout=WANDB_SECONDS, env=environ, cwd=tracking.get("cwd") or None)
    if done.returncode == 0:
        return []
    last = ([line for line in done.stderr.strip().splitlines() if line.strip()] or ["(no output)"])[-1][:300]
    return [f"warning: W&B: {failure} ({last})"]


def _by_step(paths: RunDir) -> list[tuple[int, dict[str, float]]]:
    """``nbddp.log``'s values, a row per step, by increasing step (W&B takes a run's steps only increasing)."""
    rows: dict[int, dict[str, float]] = {}
    for key, value, step, _ in _nbddp_metrics(paths):
        rows.setdefault(step, {})[key] = value
    return sorted(rows.items())


#: A batch's own note of its MLflow parent runs, in its ``--out`` folder (``--resume`` finds them again).
BATCH_RECORDS = "trackers.json"


def group_batch(out: Path, runs: list[tuple[RunDir, bool]]) -> list[str]:
    """A batch's MLflow runs (``runs``: each run's dir and whether it succeeded) nested under one parent run per
    experiment, named by the batch, marked failed when one of them failed: MLflow's compare view shows the sweep.
    (W&B's group and TensorBoard's sub-folders are given as each run writes: :mod:`nbddp.rank_side.trackers`.)

    Returns warning lines (a store that can't be reached)."""
    children = [(paths, ok, (read_json(paths.tracker_runs) or {}).get("mlflow")) for paths, ok in runs]
    children = [(paths, ok, run) for paths, ok, run in children if isinstance(run, dict) and run.get("run_id")]
    if not children:
        return []
    try:
        from mlflow.tracking import MlflowClient

        noted = read_json(out / BATCH_RECORDS) or {}
        parents: dict[str, str] = dict(noted.get("mlflow_parents") or {})
        groups: dict[tuple[str, str], list[tuple[str, bool]]] = {}
        for paths, ok, run in children:
            client = MlflowClient(with_credentials(run.get("tracking_uri") or "") or None)
            experiment = client.get_run(run["run_id"]).info.experiment_id
            groups.setdefault((run.get("tracking_uri") or "", experiment), []).append((run["run_id"], ok))
        for (uri, experiment), members in groups.items():
            client = MlflowClient(with_credentials(uri) or None)
            key = f"{uri} {experiment}"
            if key not in parents:
                parents[key] = client.create_run(experiment, run_name=out.name,
                                                 tags={"nbddp.batch": str(out)}).info.run_id
            for run_id, _ in members:
                client.set_tag(run_id, "mlflow.parentRunId", parents[key])
            client.set_terminated(parents[key], "FINISHED" if all(ok for _, ok in members) else "FAILED")
        write_json(out / BATCH_RECORDS, {**noted, "mlflow_parents": parents})
        return []
    except Exception as exc:  # noqa: BLE001 - the runs' own records stand
        return [f"warning: MLflow: the batch's runs could not be grouped under a parent run ({exception_line(exc)})"]
