"""The kernel's side of one experiment record per run (:mod:`nbddp.rank_side.trackers` is the ranks'): the
records the kernel has open, for rank 0 to write into, so that a cell after the training can log the CPU
evaluation into the same record.

* an **MLflow** run (``mlflow.active_run()``): rank 0's ``mlflow.start_run()`` resumes it (MLflow's own
  ``MLFLOW_RUN_ID``, with its tracking URI and experiment);
* a **W&B** run (``wandb.run``): rank 0's ``wandb.init()`` resumes it (``WANDB_RUN_ID``, ``WANDB_RESUME=allow``, its
  project, mode and folder);
* a **TensorBoard** writer left open (``torch.utils.tensorboard`` or ``tensorboardX``): rank 0's writer that names
  no folder of its own writes into its folder.

Each run of the cell writes into the same open record: its points come after the ones already there (a
re-run's steps start again at its own first step, later in time). Nothing here imports a tracker: only one the
kernel has imported is asked.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

from nbddp.contracts.rank_env import RankEnv
from nbddp.contracts.rundir import RunDir

#: The largest ``weights.pt`` added to a run's MLflow record as an artifact (a larger one is named by a tag).
WEIGHTS_ARTIFACT_BYTES = 100 * 2**20
#: Variables of the trackers' own that may carry a record to rank 0, and none other (nothing secret: no key,
#: no token; what the kernel's tracker holds besides stays there).
RECORD_VARIABLES = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "WANDB_RUN_ID", "WANDB_RESUME",
                    "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE", "WANDB_DIR")


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
    return f"rank 0 writes into the kernel's open {', '.join(names)}; the other ranks write none" if names else ""


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


def record_ending(paths: RunDir, record: Any, error: str = "") -> str:
    """Add how the run ended to the MLflow run rank 0 wrote (``trackers.json``): nbddp's facts as tags (status,
    run dir, notebook, engine, world size, devices, torch), its parameters and ``nbddp.log`` metrics (with their
    step) that the code didn't log to MLflow itself, ``result.json`` and the weights (up to
    :data:`WEIGHTS_ARTIFACT_BYTES`; the file's path is the tag ``nbddp.weights``) as artifacts under ``nbddp/``, and
    for a run that didn't succeed its error line (``error``, as ``nbddp.error``) and MLflow's status (``FAILED``,
    ``KILLED``).

    Returns a warning line when the store can't be reached (``""`` otherwise): the run's own ending stands.
    """
    from nbddp.contracts.atomic import read_json
    from nbddp.contracts.metrics import COUNTERS, read_metrics, step_of
    from nbddp.contracts.status import Status

    written = (read_json(paths.tracker_runs) or {}).get("mlflow")
    if not isinstance(written, dict) or not written.get("run_id"):
        return ""
    try:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        client = MlflowClient(written.get("tracking_uri") or None)
        run_id = written["run_id"]
        data = client.get_run(run_id).data
        logged = data.params
        tags = {"nbddp.status": str(record.status), "nbddp.run_dir": str(paths.path), "nbddp.notebook": record.notebook,
                "nbddp.engine": record.engine, "nbddp.world_size": str(record.world_size),
                "nbddp.devices": f"{record.devices.get('nproc')} × {record.devices.get('kind')}",
                "nbddp.torch": str(record.versions.get("torch", ""))}
        if error:
            tags["nbddp.error"] = error[:5000]
        params = [Param(str(k), str(v)[:6000]) for k, v in record.parameters.items() if str(k) not in logged]
        metrics = [Metric(key, float(value), int(float(point.get("time", 0)) * 1000), step_of(point, index))
                   for index, point in enumerate(read_metrics(paths))
                   for key, value in point.items()
                   if key not in COUNTERS and key not in data.metrics and isinstance(value, (int, float))]
        for start in range(0, len(metrics), 1000):  # (MLflow takes at most 1000 metrics a batch)
            client.log_batch(run_id, metrics=metrics[start:start + 1000])
        if paths.weights.exists():
            tags["nbddp.weights"] = str(paths.weights)
        client.log_batch(run_id, params=params, tags=[RunTag(k, v) for k, v in tags.items()])
        client.log_artifact(run_id, str(paths.result), "nbddp")
        if paths.weights.exists() and paths.weights.stat().st_size <= WEIGHTS_ARTIFACT_BYTES:
            client.log_artifact(run_id, str(paths.weights), "nbddp")
        if record.status != Status.SUCCEEDED:
            client.set_terminated(run_id, "KILLED" if record.status == Status.INTERRUPTED else "FAILED")
        return ""
    except Exception as exc:  # noqa: BLE001 - the store gone since: the run's record (result.json) stands
        reason = (str(exc).strip().splitlines() or [""])[0][:300]
        return f"warning: MLflow: how the run ended could not be added to its MLflow run ({type(exc).__name__}: {reason})"
