"""One experiment record per run (nbddp.rank_side.trackers, nbddp.job.trackers): MLflow, TensorBoard (torch's
and tensorboardX) and W&B called the way their docs write them, with no rank guard, from real ranks and real
kernels; each record read back with the tracker's own reader (MLflow's client on a sqlite store, TensorBoard's
EventAccumulator, W&B's offline run files) and its runs and points counted.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import pytest

from tests.conftest import code, wait_until, write_notebook
from tests.extras import need

EPOCHS = 3
SETUP = """#| ddp
import torch, nbddp
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)"""
#: A training cell as each tracker's docs write it: no rank guard anywhere.
LOGGING = """import mlflow, wandb
from torch.utils.tensorboard import SummaryWriter
from tensorboardX import SummaryWriter as XWriter
ddp = nbddp.prepare(model)
writer, xwriter = SummaryWriter({folder}), XWriter({xfolder})
run = wandb.init(project="nbddp", mode="offline")
with mlflow.start_run():
    mlflow.log_param("lr", 0.05)
    for epoch in range({epochs}):
        loss = ddp(torch.ones(4, 2)).square().mean()
        loss.backward()
        mlflow.log_metric("loss", loss.item(), step=epoch)
        writer.add_scalar("loss", loss.item(), epoch)
        xwriter.add_scalar("loss", loss.item(), epoch)
        wandb.log({{"loss": loss.item()}})
writer.close(); xwriter.close(); run.finish()
print("logged", flush=True)"""


def writes_on_every_rank(folder: Path) -> str:
    """Code for the end of a training cell: a TensorBoard writer made and written on every rank, with no guard (the
    tests of each door add it: Slurm, Ray, several nodes, detached). tensorboardX: the lightest tracker to import."""
    for module in ("tensorboardX", "tensorboard"):
        need(module)
    return (f"\nfrom tensorboardX import SummaryWriter as _Writer\n_writer = _Writer({str(folder)!r})\n"
            "_writer.add_scalar('rank_calls', 1.0, 0)\n_writer.close()")


def assert_one_record(folder: Path) -> None:
    """What :func:`writes_on_every_rank` left: one record (rank 0's), and nbddp's facts added to it."""
    files = sorted(folder.rglob("events.out.tfevents.*"))
    assert len([f for f in files if not f.name.endswith(".nbddp")]) == 1 and len(files) == 2, files
    assert tensorboard_points(folder, "rank_calls") == [1.0]


@pytest.fixture
def trackers_here(tmp_path, monkeypatch):
    """MLflow in a sqlite store and W&B offline, both in ``tmp_path`` (inherited by the ranks)."""
    for module in ("mlflow", "tensorboard", "tensorboardX", "wandb"):
        need(module)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)  # (a sqlite store's default experiment keeps its artifacts in ./mlruns)
    mlflow_runs(tmp_path)  # the store made once, before any rank (ranks creating one sqlite store race in its migration)
    return tmp_path


def mlflow_runs(folder: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    return [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]


def mlflow_history(folder: Path, run, key: str) -> list:
    from mlflow.tracking import MlflowClient

    return sorted(MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").get_metric_history(run.info.run_id, key),
                  key=lambda m: m.step)


def mlflow_points(folder: Path, run, key: str) -> list[float]:
    return [m.value for m in mlflow_history(folder, run, key)]


def tensorboard_points(folder: Path, key: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = []
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if key in accumulator.Tags()["scalars"]:
            points += [event.value for event in accumulator.Scalars(key)]
    return points


def wandb_records(path: Path):
    """The records of one W&B run file (``run-ID.wandb``: W&B's log of protobuf records in 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending = path.read_bytes(), 7, b""  # after the file's header (":W&B", magic, version)
    assert data[:4] == b":W&B", path
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:
            position += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if (length, kind) == (0, 0):  # the block's padding
            position += left
            continue
        pending = (b"" if kind in (1, 2) else pending) + data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_summaries(folder: Path) -> dict[str, dict]:
    """``{run id: its summary}`` over every offline run W&B wrote under ``folder`` (a resumed run's files merged)."""
    found: dict[str, dict] = {}
    for path in sorted(folder.rglob("offline-run-*/run-*.wandb")):
        summary = found.setdefault(re.match(r"run-(.+)\.wandb", path.name).group(1), {})
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "summary":
                summary |= {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.summary.update}
    return found


def wandb_runs(folder: Path, key: str = "loss") -> dict[str, list[float]]:
    """``{run id: its points of key}`` over every offline run W&B wrote under ``folder``."""
    runs: dict[str, list[float]] = {}
    for path in sorted(folder.rglob("offline-run-*/run-*.wandb")):
        run_id = re.match(r"run-(.+)\.wandb", path.name).group(1)
        points = runs.setdefault(run_id, [])
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                points += [json.loads(item.value_json) for item in record.history.item
                           if (item.key or "/".join(item.nested_key)) == key]
    return runs


@pytest.fixture
def mlflow_server(trackers_here):
    """A real MLflow tracking server (``mlflow server``) on a free loopback port, over ``trackers_here``'s sqlite
    store (made already: the server skips its migration): its URI."""
    import os
    import signal
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    store = trackers_here / "server"
    store.mkdir()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{trackers_here / 'mlflow.db'}",
         "--artifacts-destination", str(store / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"], stdout=subprocess.DEVNULL, stderr=open(store / "server.log", "wb"), start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    return answer.status == 200
            except OSError:
                assert server.poll() is None, f"the MLflow server exited:\n{(store / 'server.log').read_text()}"
                return False

        wait_until(healthy, 90, "the MLflow server answered /health", every=0.2,
                   detail=lambda: (store / "server.log").read_text())
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def server_runs(uri: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]


#: A cell the kernel alone runs (not the ranks): the notebook's own MLflow run, opened before the training.
NOTEBOOK_RUN = """import mlflow
mlflow.set_experiment("sweep")
mlflow.start_run(run_name="notebook")"""


@pytest.mark.slow
@pytest.mark.beside
def test_a_batchs_runs_give_one_record_each_per_tracker_grouped_though_every_rank_calls_them(mlflow_server, cli_run,
                                                                                            monkeypatch):
    """Against a real MLflow server: a grid of two ``nbddp run``s whose ranks both make every call gives two
    records in each tracker, not four, each with its own parameter, its points and nbddp's facts, grouped as the
    batch (an MLflow parent run, a W&B group, a TensorBoard sub-folder per grid point). Each notebook's kernel
    opened its own MLflow run before the training: rank 0 wrote into it, and the evaluation after it too."""
    from mlflow.tracking import MlflowClient

    folder = Path.cwd()  # (trackers_here's)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.replace("http://", "http://me:nbddp-secret-1@"))
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "nbddp-secret-2")  # (the test server takes any)
    monkeypatch.setenv("WANDB_API_KEY", "nbddp-secret-3" * 4)  # (offline: unused)
    write_notebook(folder / "t.ipynb", [code(NOTEBOOK_RUN), code(SETUP), code("lr = 0.05", "parameters"), code(
        "#| ddp-train\n" + LOGGING.format(folder='"tb"', xfolder='"tbx"', epochs=EPOCHS).replace(
            'mlflow.log_param("lr", 0.05)', 'mlflow.log_param("lr", lr)')),
        code('mlflow.log_metric("test_mse", 0.125)')])
    (folder / "grid.json").write_text(json.dumps({"lr": [0.1, 0.2]}))
    batch = cli_run(["batch", "t.ipynb", "--grid", "grid.json", "--cpu", "--nproc", "2", "--out", "sweep"], folder)
    assert batch.wait() == 0, batch.output
    logs = "".join(p.read_text() for p in (folder / "sweep").rglob("rank-1.log"))
    assert logs.count("logged") == 2  # rank 1 made every call, in both runs
    points = ("001-lr=0.1", "002-lr=0.2")
    client = MlflowClient(mlflow_server)
    runs = server_runs(mlflow_server)
    [parent] = [r for r in runs if "nbddp.batch" in r.data.tags]
    assert parent.info.run_name == "sweep" and parent.info.status == "FINISHED"
    children = sorted((r for r in runs if r is not parent), key=lambda r: r.data.params["lr"])
    assert [r.data.params["lr"] for r in children] == ["0.1", "0.2"]  # one per grid point, not per rank
    for run in children:  # the kernel's run: the training's points and the evaluation's, nbddp's facts
        assert run.info.run_name == "notebook" and run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert len(client.get_metric_history(run.info.run_id, "loss")) == EPOCHS
        assert run.data.metrics["test_mse"] == 0.125
        assert run.data.tags["nbddp.status"] == "succeeded" and run.data.tags["nbddp.world_size"] == "2"
    for name in ("tb", "tbx"):  # (both runs write into the folder the code names: a sub-folder each)
        assert sorted(p.name for p in (folder / name / "sweep").iterdir()) == list(points), name
        for point in points:
            assert len(tensorboard_points(folder / name / "sweep" / point, "loss")) == EPOCHS, name
            assert len(list((folder / name / "sweep" / point).glob("events.out.tfevents.*.nbddp"))) == 1  # the facts
    runs_of_wandb = wandb_runs(folder)
    assert len(runs_of_wandb) == 2 and all(len(p) == EPOCHS for p in runs_of_wandb.values()), runs_of_wandb
    facts = [wandb_run_facts(path) for path in sorted(folder.rglob("offline-run-*/run-*.wandb"))]
    assert sorted((group, name, config["lr"]) for group, name, config in facts) == [
        ("sweep", points[0], 0.1), ("sweep", points[1], 0.2)], facts
    assert all(config["nbddp"]["nbddp.world_size"] == "2" for _, _, config in facts)
    # No secret in what nbddp writes (tracking.json, trackers.json, kernel_records.json, result.json…; the logs and
    # the output notebook hold what the code printed: MLflow's own "View run at URI" line, credentials and all)
    records = list((folder / "sweep").rglob("*.json"))
    assert len(records) > 10 and not [path for path in records if b"nbddp-secret" in path.read_bytes()]


def wandb_run_facts(path: Path) -> tuple[str, str, dict]:
    """``(group, name, config)`` of one offline W&B run file."""
    group = name = ""
    config: dict = {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            group, name = record.run.run_group or group, record.run.display_name or name
            config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "config":
            config |= {item.key: json.loads(item.value_json) for item in record.config.update}
    return group, name, config


#: A training cell with no tracker in it: nbddp.log only, then rank 1 fails once every point is logged.
DIVERGES = """#| ddp-train
ddp = nbddp.prepare(model)
for epoch in range({epochs}):
    loss = ddp(torch.ones(4, 2)).square().mean()
    loss.backward()
    nbddp.log(epoch=epoch, loss=loss.item(), accuracy=0.5 + epoch / 10)
torch.distributed.barrier()
if nbddp.rank() == 1:
    raise ValueError(f"diverged at lr {{lr}}")"""


@pytest.mark.slow
@pytest.mark.beside
def test_every_rank_keeps_its_records_named_by_rank_when_asked(trackers_here, cli_run, monkeypatch):
    """Asked for, every rank's records, named by rank; MLflow in a folder store (``file:``) this time (MLflow 3.7+
    takes one only when told to: ``MLFLOW_ALLOW_FILE_STORE``)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    folder = trackers_here
    write_notebook(folder / "t.ipynb", [code(SETUP), code("#| ddp-train\n" + LOGGING.format(
        folder='"tb"', xfolder='"tbx"', epochs=EPOCHS))])
    store = f"file://{folder / 'mlruns'}"
    run = cli_run(["run", "t.ipynb", "--cpu", "--nproc", "2"], folder,
                  env={"NBDDP_TRACK_EVERY_RANK": "1", "MLFLOW_TRACKING_URI": store})
    assert run.wait() == 0, run.output
    client = MlflowClient(store)
    runs = [r for experiment in client.search_experiments() for r in client.search_runs([experiment.experiment_id])]
    assert len(runs) == 2 and {r.data.tags.get("nbddp.rank") for r in runs} == {None, "1"}
    assert all(len(client.get_metric_history(r.info.run_id, "loss")) == EPOCHS for r in runs)
    assert [r.data.tags.get("nbddp.status") for r in runs if "nbddp.rank" not in r.data.tags] == ["succeeded"]
    assert any(r.info.run_name.endswith("(rank 1)") for r in runs)
    assert len(list((folder / "tb" / "rank-1").glob("events.out.tfevents.*"))) == 1
    assert len(list((folder / "tbx" / "rank-1").glob("events.out.tfevents.*"))) == 1
    assert len(wandb_runs(folder)) == 2


#: The kernel's own records, opened before the training (as a notebook user writes them).
KERNEL_RECORDS = """import mlflow, wandb
from torch.utils.tensorboard import SummaryWriter
mlflow.set_experiment("nbddp")
mlflow.start_run(run_name="notebook")
kernel_run = wandb.init(project="nbddp", mode="offline", name="notebook")
board = SummaryWriter("board")"""
#: The training cell: MLflow and W&B with no run of their own (the kernel's is resumed), a writer with no folder.
KERNEL_TRAIN = """%%ddp_train --cpu
import mlflow, wandb
from torch.utils.tensorboard import SummaryWriter
ddp = nbddp.prepare(model)
writer = SummaryWriter()
wandb.init(project="nbddp", mode="offline")
for epoch in range({epochs}):
    loss = ddp(torch.ones(4, 2)).square().mean()
    loss.backward()
    mlflow.log_metric("loss", loss.item(), step=epoch)
    writer.add_scalar("loss", loss.item(), epoch)
    wandb.log({{"loss": loss.item()}})
writer.close(); wandb.finish()"""
#: A training cell that leaves its runs open (as a script may: its process's exit ends them).
LEAVES_OPEN = """%%ddp_train --cpu
import mlflow, random, wandb
print("drew", random.random(), flush=True)  # (the warm state puts random back: each job draws what a fresh run draws)
ddp = nbddp.prepare(model)
wandb.init(project="nbddp", mode="offline")
for epoch in range({epochs}):
    loss = ddp(torch.ones(4, 2)).square().mean()
    loss.backward()
    mlflow.log_metric("loss", loss.item(), step=epoch)
    wandb.log({{"loss": loss.item()}})
    nbddp.log(epoch=epoch, loss=loss.item(), accuracy=0.5 + epoch / 10)
{extra}"""
EVALUATION = """mlflow.log_metric("test_mse", 0.125)
kernel_run.log({"test_mse": 0.125})
board.add_scalar("test_mse", 0.125, 0)
print("KERNEL RUN", mlflow.active_run().info.run_id, kernel_run.id)"""


@pytest.mark.slow
@pytest.mark.beside
def test_the_kernels_open_records_hold_the_training_and_the_evaluation_and_a_warm_rerun_adds_to_them(
        trackers_here, monkeypatch):
    from tests.test_magic import ProtocolKernel

    folder = trackers_here
    kernel = ProtocolKernel(folder, timeout=180)
    try:
        kernel.execute("%load_ext nbddp")
        kernel.execute(SETUP)
        kernel.execute(KERNEL_RECORDS)
        first = kernel.execute(KERNEL_TRAIN.format(epochs=EPOCHS), "train")
        assert "succeeded in" in first, first
        assert ("rank 0 adds this run's points to the kernel's open MLflow run 'notebook', W&B run 'notebook', "
                "TensorBoard folder board; the other ranks write none") in first, first
        again = kernel.execute(KERNEL_TRAIN.format(epochs=EPOCHS), "train")
        assert "succeeded in" in again and "on a warm rank" in again, again
        said = kernel.execute(EVALUATION)
        mlflow_id, wandb_id = re.search(r"KERNEL RUN (\S+) (\S+)", said).groups()
        kernel.execute("board.close(); kernel_run.finish(); mlflow.end_run()")
        # The kernel's records closed: a run that leaves its own open, then one that fails, on the same warm ranks
        left_open = kernel.execute(LEAVES_OPEN.format(epochs=EPOCHS, extra=""), "train")
        assert "succeeded in" in left_open, left_open
        failed = kernel.execute(LEAVES_OPEN.format(  # (every point logged on both ranks before either raises)
            epochs=EPOCHS, extra="torch.distributed.barrier()\nraise ValueError('boom')"), "train")
        assert re.search(r"rank \d raised ValueError: boom", failed) and "on a warm rank" in failed, failed
        drawn = re.findall(r"\[rank 0\] drew (\S+)", left_open + failed)
        assert len(drawn) == 2 and drawn[0] == drawn[1], drawn
    finally:
        kernel.close()
    runs = {r.info.run_id: r for r in mlflow_runs(folder)}
    one = runs.pop(mlflow_id)  # the kernel's: the training's and the evaluation's points in it
    assert one.info.run_name == "notebook"
    assert len(mlflow_points(folder, one, "loss")) == 2 * EPOCHS and mlflow_points(folder, one, "test_mse") == [0.125]
    points = wandb_runs(folder)
    assert len(points.pop(wandb_id)) == 2 * EPOCHS  # (offline: a file per process, one run id)
    assert len(tensorboard_points(folder / "board", "loss")) == 2 * EPOCHS
    assert tensorboard_points(folder / "board", "test_mse") == [0.125]
    assert not (folder / "runs").exists() or not list((folder / "runs").rglob("events.out.tfevents.*"))
    _the_runs_left_open_were_each_their_own_and_the_failed_one_is_marked(folder, list(runs.values()), points)


def _the_runs_left_open_were_each_their_own_and_the_failed_one_is_marked(folder: Path, runs: list, points: dict) -> None:
    """A warm rank's job ended the MLflow and W&B runs it left open, as a fresh rank's exit would: each warm run
    got its own record (not the last job's, still open in the rank's process); nbddp added its facts, and marked
    the failed one failed."""
    from mlflow.tracking import MlflowClient

    runs = sorted(runs, key=lambda r: r.info.start_time)
    assert [r.info.status for r in runs] == ["FINISHED", "FAILED"], [r.info for r in runs]
    # MLflow names a run from random, which the warm state put back: each run still gets a name of its own
    assert len({r.info.run_name for r in runs}) == 2 and all(re.fullmatch(r"[a-z]+-[a-z]+-\d+", r.info.run_name)
                                                            for r in runs), [r.info.run_name for r in runs]
    assert all(len(mlflow_points(folder, r, "loss")) == EPOCHS for r in runs)
    assert [r.data.tags.get("nbddp.status") for r in runs] == ["succeeded", "failed"]  # nbddp's facts, added
    assert re.match(r"rank \d, cell \S+, line 13: ValueError: boom", runs[1].data.tags["nbddp.error"]), runs[1].data.tags
    assert runs[0].data.tags["nbddp.world_size"] == "2" and "nbddp.error" not in runs[0].data.tags
    # nbddp.log's metrics the code didn't log to MLflow itself, with their step; "loss" is not logged twice
    history = mlflow_history(folder, runs[0], "accuracy")
    assert [(m.step, m.value) for m in history] == [(epoch, 0.5 + epoch / 10) for epoch in range(EPOCHS)]
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    assert {a.path for a in client.list_artifacts(runs[0].info.run_id, "nbddp")} == {"nbddp/result.json",
                                                                                    "nbddp/weights.pt"}
    assert "nbddp.weights" not in runs[1].data.tags  # (no weights came back)
    assert len(points) == 2 and all(len(p) == EPOCHS for p in points.values()), points
    accuracy = wandb_runs(folder, "nbddp/accuracy")  # nbddp.log's, in the code's own W&B runs too
    assert [accuracy[run_id] for run_id in points] == [[0.5 + epoch / 10 for epoch in range(EPOCHS)]] * 2, accuracy
    summaries = [wandb_summaries(folder)[run_id] for run_id in points]  # the failed one has its error line
    assert sorted(summary.get("nbddp.status", "") for summary in summaries) == ["", "failed"], summaries
    assert any(re.match(r"rank \d, cell \S+, line 13: ValueError: boom", s.get("nbddp.error", "")) for s in summaries)


def test_a_tracker_that_breaks_the_guard_costs_one_line_not_the_run(tmp_path, monkeypatch, capsys):
    """A tracker's next version may move what the guard patches: one warning line, and the rank goes on."""
    import types

    from nbddp.rank_side import trackers

    broken = types.ModuleType("tensorboardX")  # no SummaryWriter at all
    monkeypatch.setitem(sys.modules, "tensorboardX", broken)
    for variable in ("WANDB_MODE", "WANDB_SILENT"):  # (what the guard sets: this process's, put back after)
        monkeypatch.setenv(variable, "")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(trackers, "_how", None)
    trackers.guard(1)
    assert "could not keep tensorboardX's records to one rank" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.beside
def test_a_tracker_that_is_unreachable_or_misconfigured_costs_one_line_not_the_run(tmp_path, cli_run):
    """MLflow's server down, W&B online without a key: one warning line each (rank 0's), and the run succeeds."""
    import socket

    for module in ("mlflow", "tensorboard", "tensorboardX", "wandb"):
        need(module)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    write_notebook(tmp_path / "t.ipynb", [code(SETUP), code("#| ddp-train\n" + LOGGING.format(
        folder='"tb"', xfolder='"tbx"', epochs=EPOCHS).replace('mode="offline"', 'mode="online"'))])
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
           "WANDB_DIR": str(tmp_path), "WANDB_BASE_URL": f"http://127.0.0.1:{port}", "WANDB_API_KEY": "",
           "WANDB_SILENT": "true"}
    run = cli_run(["run", "t.ipynb", "--cpu", "--nproc", "2"], tmp_path, env=env)
    assert run.wait() == 0, run.output
    for tracker in ("MLflow", "W&B"):
        said = [line for line in run.output.splitlines() if f"warning: {tracker} failed" in line]
        assert len(said) == 1 and said[0].startswith("[rank 0]"), run.output
    assert "[rank 0] logged" in run.output and len(tensorboard_points(tmp_path / "tb", "loss")) == EPOCHS


#: Rank 1 fails once every point is logged; rank 0 is still working when the stop's SIGTERM comes.
STOPPED = """#| ddp-train
import wandb
run = wandb.init(project="nbddp", mode="offline")
for epoch in range({epochs}):
    wandb.log({{"loss": float(epoch)}})
torch.distributed.barrier()
if nbddp.rank() == 1:
    raise ValueError("diverged")
time.sleep(60)"""


@pytest.mark.slow
@pytest.mark.beside
def test_rank_0_stopped_by_a_peers_failure_keeps_its_w_and_b_points_and_the_run_is_marked_failed_with_its_line(
        trackers_here, cli_run):
    """Python's own SIGTERM would end rank 0 with no atexit: W&B's queued points and its run's end lost."""
    folder = trackers_here
    write_notebook(folder / "t.ipynb", [code(SETUP + "\nimport time"), code(STOPPED.format(epochs=EPOCHS))])
    run = cli_run(["run", "t.ipynb", "--cpu", "--nproc", "2"], folder)
    assert run.wait() == 1 and "rank 1 raised ValueError: diverged" in run.output, run.output
    [(run_id, points)] = wandb_runs(folder).items()
    assert points == [float(epoch) for epoch in range(EPOCHS)]
    exits = [r.exit.exit_code for path in folder.rglob("offline-run-*/run-*.wandb") for r in wandb_records(path)
             if r.WhichOneof("record_type") == "exit"]
    assert exits and all(code_ == 1 for code_ in exits), exits  # (rank 0's end, and nbddp's resume for the line)
    assert re.match(r"rank 1, cell 2, line 8: ValueError: diverged", wandb_summaries(folder)[run_id]["nbddp.error"])


#: In a process of its own (the guard patches the modules of the process it runs in): a warm rank 0's job that
#: opened a run, whose MLflow then failed (its calls dropped), and that job's end.
AFTER_A_FAILURE = """import sys, mlflow
from nbddp.rank_side import trackers
trackers.guard(0)
mlflow.start_run()
trackers._fail("MLflow", RuntimeError("the server went away"))
mlflow.log_metric("dropped", 1.0)
trackers.end_job(failed=False)
print("ACTIVE", mlflow.active_run())
"""


@pytest.mark.slow
@pytest.mark.beside
def test_a_jobs_end_ends_its_open_run_even_after_mlflow_failed_in_it(tmp_path):
    import os
    import subprocess

    need("mlflow")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    done = subprocess.run([sys.executable, "-c", AFTER_A_FAILURE], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "ACTIVE None" in done.stdout, done.stdout + done.stderr
    assert done.stderr.count("warning: MLflow failed (RuntimeError: the server went away)") == 1, done.stderr


def test_rank_0_takes_the_kernels_open_records_when_the_kernel_gives_them_and_its_own_after_the_wait(
        tmp_path, monkeypatch, capsys):
    """``nbddp run``'s kernel reaches the training cell while the ranks start: rank 0's first record waits for its
    word (``kernel_records.json``), takes the records it names (a store's credentials from its own environment:
    the run dir holds none), or, when none comes in time, says so in one line and writes records of its own."""
    from nbddp.contracts.atomic import write_json
    from nbddp.contracts.rank_env import RankEnv
    from nbddp.contracts.rundir import RunDir
    from nbddp.rank_side import trackers

    paths = RunDir(tmp_path)
    write_json(paths.tracking, {"kernel_records": True, "parameters": {"lr": 0.1}, "group": ""})
    monkeypatch.setenv("NBDDP_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://me:secret@mlflow.example.com")
    for variable in ("MLFLOW_RUN_ID", "WANDB_MODE", "WANDB_SILENT", "MLFLOW_ENABLE_ASYNC_LOGGING"):
        monkeypatch.setenv(variable, "")  # (what the guard sets: this process's, put back after)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name, value in (("KERNEL_RECORDS_WAIT", 0.3), ("_how", None), ("_tracking", None)):
        monkeypatch.setattr(trackers, name, value)
    trackers.guard(0, RankEnv(run_dir=paths))
    assert trackers.facts()["parameters"] == {"lr": 0.1}
    assert "did not reach the training cell within 0.3 s" in capsys.readouterr().err
    write_json(paths.kernel_records, {"variables": {
        "MLFLOW_RUN_ID": "abc", "MLFLOW_TRACKING_URI": "https://mlflow.example.com",
        RankEnv(tensorboard_dir=tmp_path / "board").variables().popitem()[0]: str(tmp_path / "board")},
        "names": ["MLflow run 'notebook'"]})
    trackers.guard(0, RankEnv(run_dir=paths))  # (the next job: read again)
    trackers.facts()
    import os

    assert os.environ["MLFLOW_RUN_ID"] == "abc"
    assert os.environ["MLFLOW_TRACKING_URI"] == "https://me:secret@mlflow.example.com"
    assert trackers._how[2] == tmp_path / "board"
    assert "rank 0 adds this run's points to the kernel's open MLflow run 'notebook'" in capsys.readouterr().out


def test_no_credential_reaches_the_run_dir():
    from nbddp.contracts.uris import with_credentials, without_credentials

    assert without_credentials("https://me:secret@mlflow.example.com:5000/x") == "https://mlflow.example.com:5000/x"
    assert without_credentials("sqlite:////tmp/m.db") == "sqlite:////tmp/m.db"
    assert with_credentials("https://other.example.com") == "https://other.example.com"


def test_track_names_the_trackers_it_knows_at_every_door(monkeypatch):
    from nbddp.contracts.errors import UsageError
    from nbddp.plan.options import LaunchOptions, asked_trackers

    assert LaunchOptions(track="MLflow, wandb").track == ("mlflow", "wandb")
    assert LaunchOptions(track=["tensorboard"]).to_argv()[-2:] == ["--track", "tensorboard"]
    with pytest.raises(UsageError, match="--track neptune: nbddp tracks runs in mlflow, tensorboard, wandb"):
        LaunchOptions(track="neptune")
    monkeypatch.setenv("NBDDP_TRACK", "tensorboard")
    assert asked_trackers(LaunchOptions()) == ("tensorboard",) and asked_trackers(LaunchOptions(track="mlflow")) == (
        "mlflow",)
    monkeypatch.setenv("NBDDP_TRACK", "comet")
    with pytest.raises(UsageError, match="NBDDP_TRACK comet"):
        asked_trackers(LaunchOptions())


@pytest.mark.slow
@pytest.mark.beside
def test_a_batchs_mlflow_runs_nest_under_one_parent_per_experiment_found_again_on_resume(tmp_path, monkeypatch):
    """nbddp.job.trackers.group_batch on a real (sqlite) store: a parent run named by the batch, marked failed when
    a run failed; a --resume of the batch nests its runs under the same parent."""
    from mlflow.tracking import MlflowClient

    from nbddp.contracts.atomic import write_json
    from nbddp.contracts.rundir import RunDir
    from nbddp.job.trackers import group_batch

    need("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(uri)
    out = tmp_path / "sweep"
    runs = []
    for name in ("001-lr=0.1", "002-lr=0.2"):
        paths = RunDir(out / name)
        paths.path.mkdir(parents=True)
        write_json(paths.tracker_runs, {"mlflow": {"run_id": client.create_run("0").info.run_id, "tracking_uri": uri}})
        runs.append(paths)
    assert group_batch(out, [(runs[0], True), (runs[1], False)]) == []
    [parent] = [r for r in client.search_runs(["0"]) if "nbddp.batch" in r.data.tags]
    assert parent.info.run_name == "sweep" and parent.info.status == "FAILED"
    children = [client.get_run(r.info.run_id) for r in client.search_runs(["0"]) if r.info.run_id != parent.info.run_id]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id} and len(children) == 2
    assert group_batch(out, [(runs[0], True), (runs[1], True)]) == []  # --resume: the failed one ran again
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
    assert len(client.search_runs(["0"])) == 3


@pytest.mark.slow
@pytest.mark.beside
def test_a_detached_cell_writes_into_the_kernels_open_mlflow_run_and_its_facts_are_in_once_it_is_followed(
        trackers_here):
    """``%%ddp_train --detach``: the supervisor is not the kernel; the kernel's open run goes with the request.
    When the attached cell ends, nbddp's facts are in the run already (the supervisor's last work is waited for)."""
    from tests.test_magic import ProtocolKernel

    folder = trackers_here
    kernel = ProtocolKernel(folder, timeout=180)
    try:
        kernel.execute("%load_ext nbddp")
        kernel.execute(SETUP)
        kernel.execute("import mlflow\nmlflow.start_run(run_name='notebook')")
        said = kernel.execute("%%ddp_train --cpu --detach\nimport mlflow\nddp = nbddp.prepare(model)\n"
                              f"for epoch in range({EPOCHS}):\n    mlflow.log_metric('loss', float(epoch), step=epoch)\n"
                              "    nbddp.log(epoch=epoch, accuracy=0.5)", "train")
        assert "succeeded in" in said and "rank 0 adds this run's points to the kernel's open MLflow run" in said, said
        [run] = mlflow_runs(folder)  # at once: the facts are in
        kernel.execute("mlflow.log_metric('test_mse', 0.125)")
    finally:
        kernel.close()
    assert run.info.run_name == "notebook" and run.data.tags["nbddp.status"] == "succeeded"
    assert len(mlflow_points(folder, run, "loss")) == EPOCHS and len(mlflow_points(folder, run, "accuracy")) == EPOCHS
    assert mlflow_points(folder, run, "test_mse") == [0.125]


def test_weights_over_the_cap_are_named_not_copied_and_a_line_says_so(tmp_path, monkeypatch):
    from nbddp.contracts.rundir import RunDir
    from nbddp.job import trackers

    paths = RunDir(tmp_path)
    paths.result.write_text("{}")
    paths.weights.write_bytes(b"x" * 2000)
    monkeypatch.setattr(trackers, "WEIGHTS_ARTIFACT_BYTES", 1000)
    files, said = trackers._artifacts(paths, "MLflow")
    assert files == [paths.result] and said == [f"MLflow: {paths.weights} (2 kB) is over the 1 kB a record takes: its "
                                                "path is the record's nbddp.weights, not a copy"]
    monkeypatch.setattr(trackers, "WEIGHTS_ARTIFACT_BYTES", 2000)
    assert trackers._artifacts(paths, "MLflow") == ([paths.result, paths.weights], [])


def test_a_run_that_is_no_experiments_gets_nothing_added(tmp_path):
    """%%ddp_exec (``tracked=False``): nbddp adds nothing to a record, not even one rank 0 noted."""
    from nbddp.contracts.atomic import write_json
    from nbddp.contracts.rundir import RunDir
    from nbddp.job import trackers

    paths = RunDir(tmp_path)
    write_json(paths.tracking, {"tracked": False, "asked": ["mlflow", "tensorboard", "wandb"]})
    write_json(paths.tracker_runs, {"mlflow": {"run_id": "abc", "tracking_uri": "http://127.0.0.1:9"}})
    assert trackers.record_ending(paths, object()) == []


def test_a_trackers_failure_is_said_with_its_whole_line_where_the_fix_is_at_its_end(tmp_path, monkeypatch):
    """MLflow 3 refuses a plain folder as its store, and says how to opt out in its message's 500th character."""
    from nbddp.contracts.errors import exception_line

    mlflow = need("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    mlflow.set_tracking_uri(str(tmp_path / "mlruns"))
    try:
        mlflow.start_run()
        mlflow.end_run()
        pytest.skip(f"MLflow {mlflow.__version__} takes a folder as its store")
    except Exception as exc:  # noqa: BLE001 - the refusal, as rank 0 would meet it
        refused = exc
    finally:
        mlflow.set_tracking_uri(None)
    line = exception_line(refused)
    assert line.startswith("MlflowException: ") and line.endswith("set `MLFLOW_ALLOW_FILE_STORE=true` to opt out of "
                                                                   "this exception."), line
    long = exception_line(ValueError("word " * 400))
    assert len(long) <= 1000 + len("ValueError: ") + 2 and long.endswith("word …")
