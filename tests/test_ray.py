"""``--ray`` against a real local Ray cluster (``ray start --head`` on loopback, 2 CPUs, started here):
the kernel runs here, each rank in a Ray actor's process on the cluster's workers."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import StoppedLastCell, code, wait_until, write_notebook
from tests.slurm_cluster import free_port
from tests.test_trackers import assert_one_record, writes_on_every_rank
from tests.linear_fit import EVALUATE, SETUP, assert_matches, train_cell
from tests.ray_cluster import RayCluster, actor_processes
from tests.test_slurm import only_run_dir, processes_of

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # mostly waiting on the cluster and sleeping trainings

SLOW = code("#| ddp-train\nfor step in range(100000):\n    print('step', step, flush=True)\n    time.sleep(0.1)")
CPU2 = ["--cpu", "--nproc", "2"]


@pytest.fixture(scope="module")
def ray_cluster():
    try:
        import ray  # noqa: F401
    except ImportError:
        reason = "Ray is not installed here; .ci/run installs it (the test extra)"
        if os.environ.get("NBDDP_REQUIRE_RAY") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = RayCluster(cpus=2).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def ray_env(ray_cluster, monkeypatch):
    """``--ray`` alone finds the test cluster (``RAY_ADDRESS``, in this process and every child)."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    yield ray_cluster
    wait_until(lambda: not actor_processes(), 30, "every Ray actor of nbddp's ended after the test", every=0.2,
               detail=lambda: f"left alive: {[proc.pid for proc in actor_processes()]}")


def nothing_left(run, run_dir) -> bool:
    """No process of the run anywhere: not its kernel or driver, not a rank, not a rank's Ray actor."""
    return not run.leftovers() and not processes_of(run_dir) and not actor_processes()


def test_a_notebook_trains_on_two_ray_workers_and_the_weights_come_back(tmp_path, cli_run, ray_env):
    write_notebook(tmp_path / "fit.ipynb", [code(SETUP), code(train_cell(8) + writes_on_every_rank(tmp_path / "tb")),
                                            code(EVALUATE)])
    run = cli_run(["run", "fit.ipynb", "--ray", *CPU2], tmp_path)
    assert run.wait() == 0, run.output
    output, run_dir = run.output, only_run_dir(tmp_path)
    job = json.loads((run_dir / "ray" / "job.json").read_text())
    assert f"of the Ray cluster at {ray_env.address} (RAY_ADDRESS)" in output
    assert f"[launcher] ray: job {job['job_id']} on the cluster at" in output
    assert output.index("ray: running on") < output.index("[rank 1] epoch 0") < output.index("ray: rank 0 exitcode 0")
    assert "[cell 3] kernel sees weight sum" in output
    assert_matches(run_dir / "weights.pt", batch=16)  # 2 ranks × 8: the one-process computation
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "succeeded" and result["world_size"] == 2
    assert result["ray_job"]["job_id"] == job["job_id"] and result["ray_job"]["state"] == "SUCCEEDED"
    assert_one_record(tmp_path / "tb")  # a tracker called on every rank: rank 0's record alone
    assert nothing_left(run, run_dir)


def test_a_failing_rank_on_ray_names_the_notebook_cell(tmp_path, cli_run, ray_env):
    write_notebook(tmp_path / "boom.ipynb", [code(SETUP), code(
        "#| ddp-train\nfor step in range(100):\n    if step == 2 and nbddp.rank() == 1:\n"
        "        raise ValueError('bad batch')\n    torch.distributed.barrier()\n    time.sleep(0.05)"),
        code("print('EVALUATION RAN')")])
    run = cli_run(["run", "boom.ipynb", "--ray", ray_env.address, *CPU2], tmp_path)  # the address given
    assert run.wait() == 1, run.output
    assert "rank 1 raised ValueError: bad batch" in run.output and "boom.ipynb, cell 2, line 4" in run.output
    assert "[rank 1]     raise ValueError('bad batch')" in run.output and "EVALUATION RAN" not in run.output
    run_dir = only_run_dir(tmp_path)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["ray_job"]["state"] == "FAILED" and result["rank_exit_codes"]["1"] == 1
    assert nothing_left(run, run_dir)


def test_ctrl_c_timeout_and_nbddp_kill_stop_the_ray_job_and_leave_no_worker(tmp_path, cli_run, ray_env):
    write_notebook(tmp_path / "long.ipynb", [code(SETUP), SLOW, code("print('EVALUATION RAN')")])
    run = cli_run(["run", "long.ipynb", "--ray", *CPU2], tmp_path)
    run.wait_for("[rank 1] step 3")
    assert len(actor_processes()) == 2  # one Ray actor per rank, each the parent of its rank
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(120) == 130, run.output
    run_dir = only_run_dir(tmp_path)
    assert json.loads((run_dir / "result.json").read_text())["status"] == "interrupted"
    assert json.loads((run_dir / "ray" / "job.json").read_text())["state"] == "STOPPED"
    assert "EVALUATION RAN" not in run.output and nothing_left(run, run_dir)

    timed = cli_run(["run", "long.ipynb", "--ray", *CPU2, "--timeout", "12", "--run-dir", "timed"], tmp_path)
    assert timed.wait(120) == 124, timed.output
    assert "the run exceeded --timeout; every rank was stopped." in timed.output
    assert json.loads((tmp_path / "timed" / "result.json").read_text())["status"] == "timeout"
    assert nothing_left(timed, tmp_path / "timed")

    killed = cli_run(["run", "long.ipynb", "--ray", *CPU2, "--run-dir", "killed"], tmp_path)
    killed.wait_for("[rank 1] step 3")
    done = subprocess.run([sys.executable, "-m", "nbddp", "kill", str(tmp_path / "killed")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not actor_processes()  # nbddp kill returns once the actors are gone
    assert killed.wait(60) == 143, killed.output
    assert json.loads((tmp_path / "killed" / "result.json").read_text())["status"] == "interrupted"
    assert nothing_left(killed, tmp_path / "killed")


def test_a_run_asking_for_more_than_the_cluster_has_fails_within_its_timeout_saying_so(tmp_path, cli_run, ray_env):
    write_notebook(tmp_path / "long.ipynb", [code(SETUP), SLOW])
    started = time.monotonic()
    run = cli_run(["run", "long.ipynb", "--ray", "--cpu", "--nproc", "3", "--rdzv-timeout", "8"], tmp_path)
    assert run.wait(90) == 1, run.output
    assert time.monotonic() - started < 60
    said = "the cluster's 1 node (2 CPU in all) can't hold 1 node × 3 CPU ranks"
    assert said in run.output.split("[launcher] ray: waiting for the cluster to place")[0]  # at once, then waits
    assert "Ray: the cluster never placed 1 node × 3 CPU ranks within --rdzv-timeout 8 s" in run.output
    result = json.loads((only_run_dir(tmp_path) / "result.json").read_text())
    assert result["status"] == "failed" and result["ray_job"]["state"] == "NEVER_PLACED"
    assert said in result["error"] and nothing_left(run, only_run_dir(tmp_path))

    timed = cli_run(["run", "long.ipynb", "--ray", "--cpu", "--nproc", "3", "--timeout", "8", "--run-dir", "t"], tmp_path)
    assert timed.wait(90) == 124, timed.output
    assert "the run exceeded --timeout; every rank was stopped. Ray: the cluster never placed 1 node × 3 CPU" in timed.output


def test_a_driver_stopped_while_it_connects_says_the_cluster_never_placed_the_ranks(tmp_path, ray_env):
    """The stop lands while the driver imports Ray or connects (Ray's own SIGTERM handler is in place then): the
    record still says what the cluster hadn't done, and the driver ends as a stopped run, not with a traceback."""
    (tmp_path / "train.py").write_text("print('never run')\n")
    driver = subprocess.Popen([sys.executable, "-m", "nbddp.launchers.ray_main", "--address", ray_env.address,
                               "--nodes", "1", "--nproc", "3", "--start-timeout", "30", str(tmp_path / "run"),
                               str(tmp_path / "train.py")], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    job = tmp_path / "run" / "ray" / "job.json"
    wait_until(job.exists, 60, "the driver wrote its record")
    driver.send_signal(signal.SIGTERM)
    output = driver.communicate(timeout=60)[0]
    record = json.loads(job.read_text())
    assert driver.returncode == 143 and "Traceback" not in output, output
    assert record["state"] == "STOPPED", record
    assert record["ended_by"].startswith("Ray: the cluster never placed 1 node × 3 CPU ranks in the "), record


def test_no_cluster_at_the_address_is_said_at_once(tmp_path, cli_run, ray_env):
    from tests.slurm_cluster import free_port

    write_notebook(tmp_path / "long.ipynb", [code(SETUP), SLOW])
    address = f"127.0.0.1:{free_port()}"
    run = cli_run(["run", "long.ipynb", "--ray", address, *CPU2], tmp_path)
    assert run.wait(60) == 1, run.output
    assert f"Ray: no Ray cluster answers at {address}: nothing listens there. Start one" in run.output
    assert json.loads((only_run_dir(tmp_path) / "result.json").read_text())["ray_job"]["state"] == "UNREACHABLE"


def test_a_lost_ray_worker_is_reported_as_such(tmp_path, cli_run, ray_env):
    write_notebook(tmp_path / "long.ipynb", [code(SETUP), SLOW])
    run = cli_run(["run", "long.ipynb", "--ray", *CPU2], tmp_path)
    run.wait_for("[rank 1] step 3")
    actor_processes()[0].kill()  # as the node's OOM killer or a lost node would
    assert run.wait(120) == 1, run.output
    assert "Ray worker was lost (" in run.output and "every other rank was stopped" in run.output
    run_dir = only_run_dir(tmp_path)
    assert json.loads((run_dir / "ray" / "job.json").read_text())["state"] == "WORKER_LOST"
    assert nothing_left(run, run_dir)


def test_the_magic_trains_on_ray_and_its_stop_button_leaves_no_worker(tmp_path, ray_env):
    endless = "%%ddp_train --ray --cpu --nproc 2\nfor step in range(100000):\n    print('step', step, flush=True)\n    time.sleep(0.1)"
    kernel = StoppedLastCell.after_training("--ray --cpu --nproc 2", endless, tmp_path)
    try:
        kernel.assert_trained()
        wait_until(lambda: len(actor_processes()) >= 2, 120, "both ranks' Ray actors running", every=0.2)

        def at_step_3() -> bool:  # training on the cluster, with the kernel following it
            runs = sorted((tmp_path / "runs").iterdir())
            log = runs[-1] / "logs" / "rank-1.log"
            return len(runs) == 2 and log.exists() and "step 3" in log.read_text(errors="replace")

        wait_until(at_step_3, 120, "rank 1 of the endless run at its step 3 (its log in the run dir)", every=0.2)
    finally:
        kernel.stop()  # the stop button; whatever failed above, the ranks must go
    errors = kernel.errors
    assert errors and errors[0].ename == "KeyboardInterrupt"
    assert not actor_processes()
    first, second = sorted((tmp_path / "runs").iterdir())
    assert_matches(first / "weights.pt", batch=16)
    assert json.loads((second / "result.json").read_text())["status"] == "interrupted"
    assert not processes_of(second)


def test_a_batch_runs_each_run_on_ray_and_an_exported_script_runs_there_by_hand(tmp_path, cli_run, ray_env):
    write_notebook(tmp_path / "fit.ipynb", [code("#| parameters\nlr = 0.05"), code(SETUP),
                                             code(train_cell(8).replace("lr=0.05", "lr=lr"))])
    (tmp_path / "grid.json").write_text(json.dumps({"lr": [0.05, 0.01]}))
    run = cli_run(["batch", "fit.ipynb", "--grid", "grid.json", "--ray", *CPU2, "--out", "sweep"], tmp_path)
    assert run.wait(300) == 0, run.output
    runs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(runs) == 2 and all(json.loads((r / "result.json").read_text())["ray_job"]["state"] == "SUCCEEDED"
                                  for r in runs)
    assert_matches(next(r for r in runs if "0.05" in r.name) / "weights.pt", batch=16)

    exported = cli_run(["export", "fit.ipynb", "--ray", "--nproc", "2", "-o", "out/train.py"], tmp_path)
    assert exported.wait(60) == 0, exported.output
    header = (tmp_path / "out" / "train.py").read_text().splitlines()[2]
    command = header.removeprefix("# Launch: ").split("   (Ray;")[0]
    assert command.startswith("python -m nbddp.launchers.ray_main --address auto --nodes 1 --nproc 2"), header
    import shlex

    argv = shlex.split(command)
    done = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path / "out", capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ray: rank 1 exitcode 0" in done.stdout
    assert "epoch 2 rank 1 of 2" in (tmp_path / "out" / "ray-run" / "logs" / "rank-1.log").read_text()
    assert_matches(tmp_path / "out" / "train.weights.pt", batch=16)


def test_two_ray_nodes_train_as_one_run_rank_0_beside_the_kernel(tmp_path, cli_run, ray_env):
    """Last in this file: a second Ray node (a raylet of its own on this machine) joins the cluster for it."""
    node = ray_env.add_node(cpus=1)
    try:
        wait_until(lambda: ray_env.alive_nodes() >= 2, 60, "the second Ray node joined the cluster", every=1)
        write_notebook(tmp_path / "fit.ipynb", [code(SETUP), code(train_cell(8)), code(EVALUATE)])
        run = cli_run(["run", "fit.ipynb", "--ray", "--nodes", "2", "--cpu", "--nproc", "1"], tmp_path)
        assert run.wait() == 0, run.output
        assert "2 nodes × 1 CPU processes (gloo) of the Ray cluster" in run.output
        assert re.search(r"ray: running on (\S+) \[node \w+\] \(rank 0\), \1 \[node \w+\] \(rank 1\)", run.output)
        run_dir = only_run_dir(tmp_path)
        assert_matches(run_dir / "weights.pt", batch=16)  # 2 nodes × 1 rank × 8
        result = json.loads((run_dir / "result.json").read_text())
        assert [n["ranks"] for n in result["nodes"]] == [[0, 0], [1, 1]]
        node_ids = [n["node_id"] for n in result["ray_job"]["nodes"]]
        assert len(set(node_ids)) == 2  # STRICT_SPREAD: one bundle per Ray node
        assert nothing_left(run, run_dir)
    finally:
        ray_env.stop_node(node)


def test_the_doctor_finds_the_ray_cluster_and_says_when_none_answers(tmp_path, cli_run, ray_env):
    run = cli_run(["doctor", "--ray", "--cpu", "--nproc", "2", "--check", "endpoint"], tmp_path)
    assert run.wait(60) == 0, run.output
    assert "ok    endpoint  the Ray cluster at " in run.output and " answers" in run.output
    closed = free_port()
    run = cli_run(["doctor", "--ray", f"127.0.0.1:{closed}", "--check", "endpoint"], tmp_path)
    assert run.wait(60) == 1, run.output
    assert f"FAIL  endpoint  the Ray cluster at 127.0.0.1:{closed} does not answer: --ray can't place the ranks" \
        in run.output
