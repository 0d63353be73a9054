"""``nbddp batch`` with real runs on CPU (each a full ``nbddp run``: kernel + 2 gloo ranks)."""

import csv
import json
from pathlib import Path
import os
import re
import signal
import time

import pytest

from nbddp.doors.batch.schedule import load_grid, plan
from nbddp.contracts.errors import ParameterError
from nbddp.notebook.reader import read_notebook
from tests.conftest import code, docs_image, wait_until, write_notebook

PARAMS = "lr = 0.1\nbatch_size = 8\nfail_at = -1.0\nepochs = 2\nnap = 0.0\nmin_lr = 0.0"
SETUP = "#| ddp\nimport time\nimport torch\nimport nbddp\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\nX = torch.randn(64, 4)\nY = X.sum(1, keepdim=True)"
TRAIN = (
    "#| ddp-train\n"
    "if lr == fail_at:\n"
    "    raise ValueError(f'diverged at lr={lr}')\n"
    "ddp_model = nbddp.prepare(model)\n"
    "loader = nbddp.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=batch_size))\n"
    "opt = torch.optim.SGD(ddp_model.parameters(), lr=lr)\n"
    "for epoch in range(epochs):\n"
    "    for x, y in loader:\n"
    "        opt.zero_grad()\n"
    "        loss = ((ddp_model(x) - y) ** 2).mean()\n"
    "        loss.backward()\n"
    "        opt.step()\n"
    "        time.sleep(nap)\n"
    "    nbddp.log(epoch=epoch + 1, loss=loss.item())"
)


@pytest.fixture
def sweep(tmp_path):
    evaluate = "print('done')\nassert lr >= min_lr, (lr >= min_lr, lr)"  # in the kernel, after the training
    return write_notebook(tmp_path / "sweep.ipynb", [code(PARAMS, "parameters"), code(SETUP), code(TRAIN), code(evaluate)])


def test_grid_forms(tmp_path):
    assert load_grid({"a": [1, 2], "b": ["x"]}) == [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]
    assert load_grid([{"a": 1}, {"a": 2, "b": 3}]) == [{"a": 1}, {"a": 2, "b": 3}]
    (tmp_path / "g.json").write_text(json.dumps({"lr": [0.1, 0.2]}))
    (tmp_path / "g.yaml").write_text("- {lr: 0.1}\n- {lr: 0.3, batch_size: 16}\n")
    assert load_grid(tmp_path / "g.json") == [{"lr": 0.1}, {"lr": 0.2}]
    assert load_grid(tmp_path / "g.yaml") == [{"lr": 0.1}, {"lr": 0.3, "batch_size": 16}]
    for bad in ({"lr": 0.1}, [], "x", {"lr": []}, {"x=1\nimport os#": [1]}):
        with pytest.raises(ParameterError):
            load_grid(bad)
    # (--grid's value is a Path from the command line: what names no file is the grid itself, in JSON or YAML)
    assert load_grid(Path('{"lr": [1, 2]}')) == load_grid("lr: [1, 2]") == [{"lr": 1}, {"lr": 2}]
    with pytest.raises(ParameterError, match=r"--grid nope\.yaml: cannot read it \(No such file or directory\); give a "
                                             r"YAML or JSON file, or the grid itself: --grid '\{\"lr\": \[0\.1, 0\.2\]\}'\."):
        load_grid(Path("nope.yaml"))


def test_unknown_names_are_rejected_and_runs_are_named(sweep):
    notebook = read_notebook(sweep)
    with pytest.raises(ParameterError, match="unknown parameter lrate; the parameters cell defines lr, batch_size"):
        plan(notebook, [{"lrate": 1}], {})
    with pytest.raises(ParameterError, match="unknown parameter seed"):
        plan(notebook, [{"lr": 1}], {"seed": 3})
    runs = plan(notebook, load_grid({"lr": [0.1, 0.01], "batch_size": [8]}), {"epochs": 1})
    assert [r.name for r in runs] == ["001-lr=0.1-batch_size=8", "002-lr=0.01-batch_size=8"]
    assert runs[1].parameters == {"lr": 0.01, "batch_size": 8, "epochs": 1}


@pytest.mark.slow
def test_unknown_parameter_fails_before_anything_runs(sweep, tmp_path, cli_run):
    (tmp_path / "grid.yaml").write_text("lrate: [0.1, 0.2]\n")
    run = cli_run(["batch", "sweep.ipynb", "--grid", "grid.yaml", "--cpu", "--out", "out"], tmp_path)
    assert run.wait() == 2
    assert "unknown parameter lrate" in run.output
    assert not (tmp_path / "out").exists()


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.beside  # long, asserts no timing: runs beside the rest in .ci/run, where the lanes even out
@pytest.mark.slow
def test_two_by_two_grid_two_at_a_time_with_summaries(sweep, tmp_path, cli_run):
    (tmp_path / "grid.yaml").write_text("lr: [0.05, 0.1]\nbatch_size: [8, 16]\n")
    run = cli_run(["batch", "sweep.ipynb", "--grid", "grid.yaml", "--cpu", "--nproc", "2", "--parallel", "2",
                   "--out", "out", "-p", "epochs", "3"], tmp_path)
    assert run.wait() == 0, run.output
    assert "4/4 runs done, 0 failed" in run.output
    out = tmp_path / "out"
    rows = read_csv(out / "summary.csv")
    assert [(r["lr"], r["batch_size"], r["epochs"], r["status"]) for r in rows] == [
        ("0.05", "8", "3", "succeeded"), ("0.05", "16", "3", "succeeded"),
        ("0.1", "8", "3", "succeeded"), ("0.1", "16", "3", "succeeded")]
    assert all(float(r["loss"]) >= 0 and float(r["wall_time_s"]) > 0 for r in rows)
    results = [json.loads((out / r["run"] / "result.json").read_text()) for r in rows]
    assert all(res["world_size"] == 2 for res in results)
    spans = sorted((res["started_at"], res["ended_at"]) for res in results)
    assert spans[1][0] < spans[0][1], "two runs overlapped in time"
    assert all((out / r["run"] / "output.ipynb").exists() for r in rows)
    markdown = (out / "summary.md").read_text()
    assert "4 runs, 4 succeeded" in markdown and "Main metric: `loss`" in markdown
    assert markdown.count("| succeeded |") == 4
    assert (out / "summary.png").stat().st_size > 10_000
    if (picture := docs_image("batch_summary.png")) is not None:
        picture.write_bytes((out / "summary.png").read_bytes())
    assert not run.leftovers()


@pytest.mark.beside  # long, asserts no timing: runs beside the rest in .ci/run, where the lanes even out
@pytest.mark.slow
def test_a_failing_run_is_recorded_and_resume_reruns_only_the_rest(sweep, tmp_path, cli_run):
    """A run whose rank raises and one whose evaluation cell (in the kernel, after the training) fails an
    assertion: each one's error, type and message, cell and line, is in both summaries and on one terminal line."""
    (tmp_path / "grid.json").write_text(json.dumps([{"lr": 0.1}, {"lr": 0.5, "fail_at": 0.5}, {"lr": 0.2},
                                                    {"lr": 0.3, "min_lr": 0.4}]))
    args = ["batch", "sweep.ipynb", "--grid", "grid.json", "--cpu", "--parallel", "2", "--out", "out", "-p", "epochs", "1"]
    run = cli_run(args, tmp_path)
    assert run.wait() == 1, run.output
    out = tmp_path / "out"
    rows = {r["lr"]: r for r in read_csv(out / "summary.csv")}
    assert rows["0.1"]["status"] == rows["0.2"]["status"] == "succeeded"
    assert rows["0.5"]["status"] == rows["0.3"]["status"] == "failed"
    rank_error = rows["0.5"]["error"]  # (both ranks raise: the root cause is whichever did first)
    kernel_error = "cell 4, line 2: AssertionError: (False, 0.3)"
    assert rank_error in ("rank 0, cell 3, line 3: ValueError: diverged at lr=0.5",
                          "rank 1, cell 3, line 3: ValueError: diverged at lr=0.5")
    assert rows["0.3"]["error"] == kernel_error
    markdown = (out / "summary.md").read_text()
    assert f"| {rank_error} |" in markdown and f"| {kernel_error} |" in markdown
    lines = run.output.splitlines()
    assert f"nbddp: {rows['0.5']['run']} failed: {rank_error}" in lines, run.output
    assert f"nbddp: {rows['0.3']['run']} failed: {kernel_error}" in lines, run.output
    assert "nbddp: 2/4 runs succeeded; summary in" in run.output
    result = json.loads((out / rows["0.5"]["run"] / "result.json").read_text())
    assert "sweep.ipynb, cell 3, line 3" in result["error"]
    before = {name: (out / rows[name]["run"] / "result.json").stat().st_mtime for name in ("0.1", "0.2")}

    again = cli_run([*args, "--resume"], tmp_path)
    assert again.wait() == 1
    assert {name: (out / rows[name]["run"] / "result.json").stat().st_mtime for name in ("0.1", "0.2")} == before
    assert (out / f"{rows['0.5']['run']}.try1" / "result.json").exists()  # the first try is kept
    assert [r["status"] for r in read_csv(out / "summary.csv")] == ["succeeded", "failed", "succeeded", "failed"]


@pytest.mark.waits  # mostly a timeout or a mid-training signal: runs beside the rest in .ci/run
@pytest.mark.slow
@pytest.mark.parametrize("sig, expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_ctrl_c_stops_every_run_and_leaves_a_resumable_folder(sweep, tmp_path, cli_run, sig, expected):
    (tmp_path / "grid.yaml").write_text("lr: [0.1, 0.2, 0.3]\n")
    args = ["batch", "sweep.ipynb", "--grid", "grid.yaml", "--cpu", "--parallel", "2", "--out", "out"]
    run = cli_run([*args, "-p", "nap", "0.5", "-p", "epochs", "20"], tmp_path)
    def two_mid_training() -> bool:
        assert run.proc.poll() is None, run.output  # (the batch ended: it never will)
        return len(list((tmp_path / "out").glob("*/metrics.jsonl"))) >= 2

    wait_until(two_mid_training, 120, "two runs mid-training", every=0.05, detail=lambda: run.output)
    if sig == signal.SIGINT:
        os.killpg(run.proc.pid, sig)  # Ctrl-C: the terminal signals the batch's whole process group
    else:
        run.proc.send_signal(sig)  # kill PID (nbddp kill), or a closed terminal
    sent = time.monotonic()
    assert run.wait(timeout=60) == expected, run.output
    assert time.monotonic() - sent < 15
    assert not run.leftovers(grace=1)
    rows = read_csv(tmp_path / "out" / "summary.csv")
    assert "succeeded" not in [r["status"] for r in rows]
    stopped = [r for r in rows if r["status"] == "interrupted"]
    assert len(stopped) == 2, rows  # the two that were training; the third never started
    name = signal.Signals(sig).name  # each run says what stopped the batch: the user's Ctrl-C is SIGINT
    for row in stopped:
        assert row["error"] == f"interrupted ({name}); every rank's job was stopped.", rows  # (a slot's warm ranks)
        result = json.loads((tmp_path / "out" / row["run"] / "result.json").read_text())
        assert result["status"] == "interrupted" and result["exit_code"] == expected, result

    if sig != signal.SIGINT:
        return  # what --resume does doesn't depend on the signal that stopped the batch: resumed once, below
    resumed = cli_run([*args, "--resume", "-p", "epochs", "1"], tmp_path)  # now quick: no nap, 1 epoch
    assert resumed.wait() == 0, resumed.output
    assert [r["status"] for r in read_csv(tmp_path / "out" / "summary.csv")] == ["succeeded"] * 3


def rank_pids(run_dir):
    return sorted(json.loads(p.read_text())["pid"] for p in (run_dir / "ranks").glob("rank-*.json"))


@pytest.mark.beside  # long (six batch runs), asserts no timing: evens out .ci/run's lanes
@pytest.mark.slow
def test_a_slots_runs_share_warm_ranks_until_one_fails_and_match_fresh_runs(sweep, tmp_path, cli_run):
    """Warm ranks in a batch: consecutive runs on one slot reuse its ranks, through a failed run too: every rank
    left it, and they joined a new process group before the next run. The grid varies what only the training
    reads: the slot runs the setup cell once, and every run's weights are still a fresh run's."""
    import torch

    (tmp_path / "grid.json").write_text(json.dumps([{"lr": 0.1}, {"lr": 0.1}, {"lr": 0.5, "fail_at": 0.5}, {"lr": 0.1}]))
    run = cli_run(["batch", "sweep.ipynb", "--grid", "grid.json", "--cpu", "--nproc", "2", "--out", "warm"], tmp_path)
    assert run.wait() == 1, run.output
    runs = sorted(p for p in (tmp_path / "warm").iterdir() if p.is_dir())
    logs = [(r / "batch.log").read_text() for r in runs]
    assert all("on the batch's warm ranks" in log for log in logs), logs
    assert "starting fresh" not in "".join(logs), logs
    pids = [rank_pids(r) for r in runs]
    assert pids[0] == pids[1] == pids[2] == pids[3]
    setup = [re.findall(r"\[nbddp\] (setup: .*)", (r / "logs" / "rank-0.log").read_text()) for r in runs]
    assert setup == [["setup: cell 2 ran; kept for the next run"]] + [["setup: cell 2 kept"]] * 3, setup
    assert not run.leftovers()

    # Fresh runs to compare with: the grid's first two (its failing run and the one after it add nothing here).
    (tmp_path / "fresh.json").write_text(json.dumps([{"lr": 0.1}, {"lr": 0.1}]))
    fresh = cli_run(["batch", "sweep.ipynb", "--grid", "fresh.json", "--cpu", "--nproc", "2", "--out", "fresh",
                     "--fresh"], tmp_path)
    assert fresh.wait() == 0, fresh.output
    fresh_runs = sorted(p for p in (tmp_path / "fresh").iterdir() if p.is_dir())
    assert "warm ranks" not in (fresh_runs[0] / "batch.log").read_text()
    assert rank_pids(fresh_runs[0]) != rank_pids(fresh_runs[1])
    weights = [torch.load(r / "weights.pt")["returns"]["model"] for r in (runs[0], runs[1], runs[3], fresh_runs[0])]
    for other in weights[1:]:
        torch.testing.assert_close(other, weights[0], rtol=0, atol=0)
    assert not fresh.leftovers()


@pytest.mark.slow
def test_python_api_returns_the_summary(sweep, tmp_path):
    import nbddp

    result = nbddp.batch(sweep, {"lr": [0.1]}, parameters={"epochs": 1}, cpu=True, out=tmp_path / "api", quiet=True)
    assert isinstance(result, nbddp.BatchResult)  # one type, whatever is installed (pandas or not)
    assert [(r["lr"], r["status"]) for r in result.rows] == [(0.1, "succeeded")]
    assert result.succeeded and result.exit_code == 0 and result.out == tmp_path / "api"


def test_gpu_slots_pin_disjoint_devices(monkeypatch):
    """Simulated: this machine has no GPU, so the count is patched; the slot arithmetic is real."""
    from nbddp.doors.batch import schedule as batches
    from nbddp.doors.batch.schedule import BatchOptions, device_slots
    from nbddp.contracts.errors import DeviceError
    from nbddp.plan.options import LaunchOptions

    monkeypatch.setattr(batches, "visible_gpu_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5,6")
    options = BatchOptions("nb.ipynb", {}, gpus_per_run=2)
    assert device_slots(options, print) == ([("3", "4"), ("5", "6")], 2, "cuda")
    assert device_slots(BatchOptions("nb.ipynb", {}, gpus_per_run=3), print) == ([("3", "4", "5")], 3, "cuda")
    assert device_slots(BatchOptions("nb.ipynb", {}), print)[0] == [("3",), ("4",), ("5",), ("6",)]
    assert device_slots(BatchOptions("nb.ipynb", {}, parallel=2), print)[0] == [("3",), ("4",)]
    with pytest.raises(DeviceError, match=r"^--gpus-per-run 5 asks for more GPUs per run than the 4 visible\.$"):
        device_slots(BatchOptions("nb.ipynb", {}, gpus_per_run=5), print)
    with pytest.raises(DeviceError, match=r"^--gpus 5 asks for more GPUs"):  # (the option the user typed)
        device_slots(BatchOptions("nb.ipynb", {}, LaunchOptions(gpus="5")), print)
    monkeypatch.setattr(batches, "visible_gpu_count", lambda: 0)
    with pytest.raises(DeviceError, match=r"^--gpus 4: no GPU is visible\. Use --cpu --nproc N\.$"):
        device_slots(BatchOptions("nb.ipynb", {}, LaunchOptions(gpus="4")), print)


@pytest.mark.parametrize("cluster", ["slurm", "ray"])
def test_gpus_per_run_is_refused_where_a_cluster_places_the_runs(cluster):
    """--gpus-per-run counts this machine's GPUs, as --gpus does: refused with --slurm/--ray in the same words."""
    from nbddp.doors.batch.schedule import BatchOptions
    from nbddp.contracts.errors import UsageError
    from nbddp.plan.options import LaunchOptions, RayRequest, SlurmRequest

    launch = LaunchOptions(**{cluster: SlurmRequest() if cluster == "slurm" else RayRequest()})
    with pytest.raises(UsageError, match=f"--gpus-per-run counts this machine's GPUs; with --{cluster} say "
                                         "--gpus-per-node G"):
        BatchOptions("nb.ipynb", {}, launch, gpus_per_run=2)


@pytest.mark.beside  # long, asserts no timing: runs beside the rest in .ci/run, where the lanes even out
@pytest.mark.slow
def test_launch_options_reach_every_run_of_a_batch(tmp_path, cli_run):
    """--max-restarts (resuming from the checkpoint) and the timeouts mean in a batch what they mean in `nbddp run`."""
    write_notebook(tmp_path / "r.ipynb", [
        code("lr = 0.1", "parameters"),
        code("#| ddp\nimport os\nimport torch\nimport nbddp\nmodel = torch.nn.Linear(2, 1)"),
        code("#| ddp-train\nnbddp.prepare(model)\ndone = nbddp.restore(model=model)\nstart = done.get('epoch', -1) + 1\n"
             "print('attempt', nbddp.restart_count(), 'starts at epoch', start, flush=True)\n"
             "for epoch in range(start, 2):\n"
             "    if epoch == 1 and nbddp.rank() == 1 and nbddp.restart_count() == 0:\n"
             "        raise RuntimeError('the first attempt fails')\n"
             "    torch.distributed.barrier()  # as a training step would: rank 0 can't save ahead of rank 1\n"
             "    nbddp.save_checkpoint(model=model, epoch=epoch)\n"
             "nbddp.log(epoch=1, loss=lr)"),
    ])
    (tmp_path / "grid.yaml").write_text("lr: [0.1, 0.2]\n")
    run = cli_run(["batch", "r.ipynb", "--grid", "grid.yaml", "--cpu", "--parallel", "2", "--out", "out",
                   "--max-restarts", "1", "--idle-timeout", "120", "--collective-timeout", "60"], tmp_path)
    assert run.wait() == 0, run.output
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("*/result.json"))]
    assert [r["overrides"] for r in results] == [{"lr": 0.1}, {"lr": 0.2}]
    for result in results:
        assert result["status"] == "succeeded" and result["restarts"] == 1, result
        assert "--max-restarts 1" in result["command"] and "--idle-timeout 120.0" in result["command"]
        assert "--collective-timeout 60.0" in result["command"]
    for log in sorted((tmp_path / "out").glob("*/logs/rank-0.log")):
        assert "attempt 1 starts at epoch 1" in log.read_text(), log.read_text()  # resumed from epoch 0's save
    again = cli_run(["batch", "r.ipynb", "--grid", "grid.yaml", "--cpu", "--out", "out", "--resume"], tmp_path)
    assert again.wait() == 0 and "2/2 runs succeeded" in again.output


def test_a_run_refuses_a_batch_pool_it_cant_use_and_says_why(tmp_path, monkeypatch):
    """``nbddp run`` under a batch adopts the slot's pool only when it can take the run."""
    import os
    import subprocess
    import sys
    from dataclasses import asdict

    from nbddp.contracts.devices import resolve
    from nbddp.contracts.pool_dir import PoolDir
    from nbddp.launchers.warm.keepers import POOL_ENV, batch_slot
    from nbddp.launchers.warm.rules import pool_key, why_not_warm
    from nbddp.plan.options import LaunchOptions, Nodes

    devices = resolve(cpu=True, nproc=2)
    monkeypatch.setenv(POOL_ENV, str(tmp_path / "gone"))
    assert batch_slot().pool_for(devices, tmp_path, LaunchOptions()) == (
        None, "not on the batch's warm ranks (they are gone): starting fresh ones")

    folder = tmp_path / "pool"
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    key = pool_key(devices, tmp_path, LaunchOptions(), dict(os.environ))
    PoolDir(folder).description.write_text(json.dumps({"key": asdict(key), "idle": 600.0, "pid": dead.pid,
                                                       "pgid": dead.pid}))
    monkeypatch.setenv(POOL_ENV, str(folder))
    pool, said = batch_slot().pool_for(resolve(cpu=True, nproc=1), tmp_path, LaunchOptions())
    assert pool is None and "(the devices changed (2 cpu → 1 cpu))" in said
    pool, said = batch_slot().pool_for(devices, tmp_path, LaunchOptions())
    assert pool is None and "(the warm ranks had exited (idle, or stopped))" in said
    # The one rule: what warm ranks can't serve at all is never offered a pool (the batch sets none for it).
    assert "spawns its own ranks" in why_not_warm("catalyst", LaunchOptions())
    assert why_not_warm("lightning", LaunchOptions()) == ""  # torchrun starts its ranks: warm ones serve it
    assert "one machine" in why_not_warm("torch", LaunchOptions(nodes=Nodes(2, 0, "h:1")))
    assert "--max-restarts" in why_not_warm("torch", LaunchOptions(max_restarts=1))
    assert why_not_warm("torch", LaunchOptions()) == ""


def test_a_batch_knows_its_pool_busy_with_a_job_a_dead_run_handed_out(tmp_path):
    """The batch hands out no job itself (its runs do): a run killed mid-job leaves its ranks busy, and
    the batch must see it (``busy()``: the slot's next run gets fresh ranks) from the folder."""
    from nbddp.contracts.devices import resolve
    from nbddp.contracts.pool_dir import PoolDir
    from nbddp.launchers.warm.pool import WarmPool

    pool = WarmPool.__new__(WarmPool)  # the batch's own view of its pool: it started it, handed out nothing
    pool.devices, pool.dir, pool.runs = resolve(cpu=True, nproc=2), PoolDir(tmp_path), 0
    pool.dir.jobs.mkdir(parents=True)
    pool.dir.job_exits_dir.mkdir()
    assert not pool.busy()
    pool.dir.job(0).write_text("{}")  # a run adopted the pool and handed it job 0
    pool.dir.job_exit(0, 0).write_text('{"status": "ok"}')
    assert pool.busy()  # rank 1 is still in it: the run died before it ended
    pool.dir.job_exit(0, 1).write_text('{"status": "ok"}')
    assert not pool.busy()
