"""``--slurm`` against a real single-node Slurm cluster (Debian's slurm-wlm + munge, started here),
2 CPU ranks per job: the kernel runs here, the ranks as a Slurm job."""

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from nbddp.contracts.rundir import RunDir
from tests.conftest import CliRun, StoppedLastCell, code, kill_group, md, wait_until, write_notebook
from tests.test_trackers import assert_one_record, writes_on_every_rank
from tests.linear_fit import EVALUATE, SETUP, assert_matches, resumable_train_cell, train_cell
from tests.slurm_cluster import SlurmCluster, missing_tools

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # on the scheduler

SLOW = code("#| ddp-train\nfor step in range(100000):\n    print('step', step, flush=True)\n    time.sleep(0.1)")
CPU2 = ["--slurm", "--cpu", "--nproc", "2"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_tools()
    if missing:
        reason = f"Slurm is not installed here ({', '.join(missing)} missing); .ci/run installs slurm-wlm and munge"
        if os.environ.get("NBDDP_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm_env(slurm, monkeypatch):
    """Slurm's commands, in this process and every child, talk to the test cluster."""
    for key, value in slurm.env.items():
        monkeypatch.setenv(key, value)
    yield slurm
    slurm.wait_until_empty(30, "no job left in the queue after the test")


def only_run_dir(folder):
    (run_dir,) = (folder / "runs").iterdir()
    return run_dir


def first_save(folder, saved: str, timeout: float = 120):
    """The run dir of ``folder``'s run once its first checkpoint (``saved``, in the run dir) is written."""
    found = wait_until(lambda: list(folder.glob(f"runs/*/{saved}")), timeout, f"a run in {folder} wrote {saved}",
                       every=0.2)
    return found[0].parents[len(Path(saved).parts) - 1]


def processes_of(run_dir) -> list[psutil.Process]:
    """Processes anywhere on the machine (Slurm starts ranks under its own daemons) running this run."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(run_dir) in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def test_a_slurm_run_goes_from_pending_to_weights_back_and_cpu_evaluation(tmp_path, cli_run, slurm_env):
    write_notebook(tmp_path / "fit.ipynb", [code(SETUP), code(train_cell(8) + writes_on_every_rank(tmp_path / "tb")),
                                            code(EVALUATE)])
    run = cli_run(["run", "fit.ipynb", *CPU2, "--slurm-arg", "begin=now+3"], tmp_path)
    assert run.wait() == 0, run.output
    output = run.output
    job_id = json.loads((only_run_dir(tmp_path) / "slurm" / "job.json").read_text())["job_id"]
    assert f"slurm job {job_id}: submitted" in output
    assert f"slurm job {job_id}: pending (BeginTime)" in output
    assert output.index("pending") < output.index(f"slurm job {job_id}: running on") < output.index("[rank 1] epoch 0")
    assert "[cell 3] kernel sees weight sum" in output
    assert_matches(only_run_dir(tmp_path) / "weights.pt", batch=16)
    result = json.loads((only_run_dir(tmp_path) / "result.json").read_text())
    assert result["status"] == "succeeded" and result["slurm_job"]["state"] == "COMPLETED"
    assert_one_record(tmp_path / "tb")  # a tracker called on every rank: rank 0's record alone
    assert not run.leftovers() and not processes_of(only_run_dir(tmp_path))


def test_a_failing_rank_on_slurm_names_the_notebook_cell(tmp_path, cli_run, slurm_env):
    write_notebook(tmp_path / "boom.ipynb", [md("# intro"), code(SETUP), code(
        "#| ddp-train\nfor step in range(100):\n    if step == 2 and nbddp.rank() == 1:\n"
        "        raise ValueError('bad batch')\n    torch.distributed.barrier()\n    time.sleep(0.05)"),
        code("print('EVALUATION RAN')")])
    run = cli_run(["run", "boom.ipynb", *CPU2], tmp_path)
    assert run.wait() == 1, run.output
    assert "rank 1 raised ValueError: bad batch" in run.output and "boom.ipynb, cell 3, line 4" in run.output
    assert "EVALUATION RAN" not in run.output
    result = json.loads((only_run_dir(tmp_path) / "result.json").read_text())
    assert result["slurm_job"]["state"] == "FAILED" and result["rank_exit_codes"]["1"] == 1
    assert not run.leftovers() and not processes_of(only_run_dir(tmp_path))


def test_ctrl_c_cancels_the_job_and_leaves_nothing(tmp_path, cli_run, slurm_env):
    """For good: a job that would requeue itself (it saves checkpoints) is cancelled, not requeued."""
    saving = code(SLOW["source"] + "\n    nbddp.save_checkpoint(step=step)")
    write_notebook(tmp_path / "long.ipynb", [code(SETUP), saving, code("print('EVALUATION RAN')")])
    run = cli_run(["run", "long.ipynb", "--slurm"], tmp_path)  # no device flags: the partition's (no GPUs)
    run.wait_for("[rank 1] step 3")
    assert "the partition's nodes list no GPUs: 2 CPU processes (gloo) per node" in run.output
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(150) == 130, run.output
    assert slurm_env.queue() == []  # nbddp waited until the job left the queue
    assert "cancelled; it has left the queue" in run.output
    run_dir = only_run_dir(tmp_path)
    assert json.loads((run_dir / "result.json").read_text())["status"] == "interrupted"
    assert "#SBATCH --requeue" in (run_dir / "slurm" / "job.sbatch").read_text().splitlines()
    assert json.loads((run_dir / "slurm" / "job.json").read_text())["restarts"] == 0
    assert not run.leftovers() and not processes_of(run_dir)


def test_timeout_cancels_the_job_and_exits_124(tmp_path, cli_run, slurm_env):
    write_notebook(tmp_path / "long.ipynb", [code(SETUP), SLOW])
    run = cli_run(["run", "long.ipynb", *CPU2, "--timeout", "12"], tmp_path)
    assert run.wait(200) == 124, run.output
    assert slurm_env.queue() == [] and "cancelled; it has left the queue" in run.output
    assert json.loads((only_run_dir(tmp_path) / "result.json").read_text())["status"] == "timeout"
    assert not run.leftovers() and not processes_of(only_run_dir(tmp_path))


def test_an_outside_scancel_is_reported_as_such(tmp_path, cli_run, slurm_env):
    write_notebook(tmp_path / "long.ipynb", [code(SETUP), SLOW])
    run = cli_run(["run", "long.ipynb", *CPU2], tmp_path)
    run.wait_for("[rank 1] step 3")
    (job,) = slurm_env.queue()
    slurm_env.command(["scancel", job])
    assert run.wait(150) == 1, run.output
    assert f"Slurm: job {job} was cancelled outside nbddp" in run.output
    assert not run.leftovers() and not processes_of(only_run_dir(tmp_path))


def test_the_magic_submits_to_slurm_and_stays_interruptible_while_pending(tmp_path, slurm_env):
    pending = "%%ddp_train --slurm --cpu --nproc 2 --slurm-arg begin=now+600\nprint('never')"
    kernel = StoppedLastCell.after_training("--slurm --cpu --nproc 2", pending, tmp_path)
    try:
        kernel.assert_trained()
        wait_until(slurm_env.queue, 60, "the job in the Slurm queue", every=0.2)

        def seen_pending() -> bool:  # pending in the queue, with the kernel's run watching it
            runs = sorted((tmp_path / "runs").iterdir())
            job = RunDir(runs[-1]).slurm_job
            if len(runs) < 2 or not job.exists():
                return False
            record = json.loads(job.read_text())  # (with Slurm's reason once the watcher has asked: not at submit)
            return record.get("state") == "PENDING" and "reason" in record

        wait_until(seen_pending, 60, "the kernel's run watching its job pending (its slurm/job.json)", every=0.2)
    finally:
        kernel.stop()  # whatever failed above, the pending job must go
    errors = kernel.errors
    assert errors and errors[0].ename == "KeyboardInterrupt"
    assert slurm_env.queue() == []
    first, second = sorted((tmp_path / "runs").iterdir())
    assert_matches(first / "weights.pt", batch=16)
    assert json.loads((second / "result.json").read_text())["status"] == "interrupted"


def test_a_batch_submits_each_run_to_slurm(tmp_path, cli_run, slurm_env):
    """... sharded (--shard reaches every run's script and the Slurm job's ranks: FSDP2 gives DDP's weights)."""
    write_notebook(tmp_path / "fit.ipynb", [code("#| parameters\nlr = 0.05"), code(SETUP),
                                             code(train_cell(8).replace("lr=0.05", "lr=lr"))])
    (tmp_path / "grid.json").write_text(json.dumps({"lr": [0.05, 0.01]}))
    run = cli_run(["batch", "fit.ipynb", "--grid", "grid.json", *CPU2, "--parallel", "2", "--out", "sweep", "--shard"],
                  tmp_path)
    assert run.wait(300) == 0, run.output
    dirs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(dirs) == 2
    for run_dir in dirs:
        assert json.loads((run_dir / "slurm" / "job.json").read_text())["state"] == "COMPLETED"
        assert "_nbddp.start(shard=True)" in (run_dir / "train.py").read_text()
    assert_matches(dirs[0] / "weights.pt", batch=16)  # lr=0.05: one process's weights
    assert "2 succeeded" in (tmp_path / "sweep" / "summary.md").read_text() or "2/2 runs succeeded" in run.output
    assert not run.leftovers()


def test_exported_sbatch_script_submits_by_hand_and_quotes_every_value(tmp_path, cli_run, slurm_env):
    write_notebook(tmp_path / "fit.ipynb", [code(SETUP), code(train_cell(8))])
    canary = tmp_path / "injected"
    export = cli_run(["export", "fit.ipynb", "-o", "job/train.py", *CPU2,
                      "--slurm-arg", f"comment=$(touch {canary}) it's"], tmp_path)
    assert export.wait() == 0, export.output
    job_dir = tmp_path / "job"
    assert "sbatch train.sbatch" in (job_dir / "train.py").read_text()
    (job_dir / "tmp").mkdir()  # torchrun run by hand leaves torchelastic_* in TMPDIR: keep it here
    done = subprocess.run(["sbatch", "--parsable", "train.sbatch"], cwd=job_dir, capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(job_dir / "tmp")})
    assert done.returncode == 0, done.stderr
    slurm_env.wait_until_empty(120, "the job submitted by hand ran and left the queue")
    assert not canary.exists()
    assert (job_dir / "train.weights.pt").exists(), (job_dir / "node-0.log").read_text()
    assert_matches(job_dir / "train.weights.pt", batch=16)


def test_nbddp_kill_cancels_a_slurm_run_and_waits_for_the_queue(tmp_path, cli_run, slurm_env):
    write_notebook(tmp_path / "long.ipynb", [code(SETUP), SLOW])
    run = cli_run(["run", "long.ipynb", *CPU2], tmp_path)
    run.wait_for("[rank 1] step 3")
    run_dir = only_run_dir(tmp_path)
    killed = subprocess.run(["nbddp", "kill", str(run_dir)], capture_output=True, text=True, timeout=200)
    assert killed.returncode == 0, killed.stderr
    assert slurm_env.queue() == []
    assert run.wait(60) == 143, run.output
    assert json.loads((run_dir / "result.json").read_text())["status"] == "interrupted"
    assert not run.leftovers() and not processes_of(run_dir)


def test_a_lightning_notebook_trains_on_slurm_as_torchruns_ranks(tmp_path, cli_run, slurm_env):
    """On a Slurm node Slurm's variables are there beside torchrun's (one task per node: SLURM_PROCID counts
    nodes); Lightning's ranks must be torchrun's, and give the weights of one process with the global batch."""
    import torch

    from tests.framework_notebooks import LIGHTNING

    write_notebook(tmp_path / "lit.ipynb", LIGHTNING.cells())
    run = cli_run(["run", "lit.ipynb", *CPU2], tmp_path)
    assert run.wait() == 0, run.output
    assert "runs as strategy='ddp' on 2 process(es)" in run.output and "[cell 3] kernel loss" in run.output
    weights = torch.load(only_run_dir(tmp_path) / "weights.pt", weights_only=True)["returns"]["model"]
    for name, value in LIGHTNING.reference(tmp_path).items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert not run.leftovers() and not processes_of(only_run_dir(tmp_path))


@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "sharded"])
def test_a_job_requeued_by_slurm_resumes_from_its_checkpoint_as_one_run(tmp_path, cli_run, slurm_env, shard):
    """``scontrol requeue`` (an administrator, or preemption on a cluster that requeues): Slurm kills the
    ranks wherever they are; the same run follows the next attempt, which resumes from the last save
    (a sharded model's too: every rank's shard, through torch.distributed.checkpoint)."""
    write_notebook(tmp_path / "fit.ipynb", [code(SETUP), code(resumable_train_cell(8, 4)), code(EVALUATE)])
    run = cli_run(["run", "fit.ipynb", *CPU2, *(["--shard"] if shard else [])], tmp_path)
    run_dir = first_save(tmp_path, "resume.dcp/latest.json" if shard else "resume.pt")
    (job,) = slurm_env.queue()
    slurm_env.command(["scontrol", "requeue", job])
    assert run.wait(300) == 0, run.output
    output = run.output
    assert f"slurm job {job}: requeued by Slurm (scontrol requeue" in output and "→ attempt 2" in output
    assert f"slurm job {job}: running on" in output and "(attempt 2)" in output
    assert f"[rank 0] [nbddp] attempt 2: resumed from {'resume.dcp/save-' if shard else 'resume.pt ('}" in output
    assert "[cell 3] kernel sees weight sum" in output
    assert_matches(run_dir / "weights.pt", batch=16)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "succeeded" and result["restarts"] == 1
    attempts = result["slurm_job"]["attempts"]
    assert [a["attempt"] for a in attempts] == [1, 2] and attempts[0]["how"].startswith("requeued by Slurm")
    assert not run.leftovers() and not processes_of(run_dir)


def test_a_preempted_job_stops_at_its_next_checkpoint_and_resumes_after_the_urgent_job(tmp_path, cli_run, slurm_env):
    """The cluster preempts with PreemptMode=REQUEUE and preempt_send_user_signal (GraceTime 60 s): an
    --exclusive job in a higher partition takes the node; ours gets its USR2 at once, every rank stops at
    the next save, the job requeues, waits while the urgent job runs, and resumes from that save."""
    write_notebook(tmp_path / "fit.ipynb", [code(SETUP), code(resumable_train_cell(8, 6)), code(EVALUATE)])
    run = cli_run(["run", "fit.ipynb", *CPU2], tmp_path)
    run_dir = first_save(tmp_path, "resume.pt")
    urgent = slurm_env.command(["sbatch", "--parsable", "-p", "urgent", "--exclusive", "--output",
                                str(tmp_path / "urgent.out"), "--wrap", "sleep 8"]).stdout.strip()
    assert run.wait(300) == 0, run.output
    output = run.output
    stopped = re.search(r"every rank saved at this checkpoint \(epoch=(\d)\) and stops", output)
    assert stopped, output
    assert f"[rank 0] [nbddp] attempt 2: resumed from resume.pt (epoch={stopped.group(1)})" in output
    assert "→ attempt 2" in output and "(attempt 2)" in output
    assert_matches(run_dir / "weights.pt", batch=16)
    assert "JobState=COMPLETED" in slurm_env.command(["scontrol", "show", "job", urgent]).stdout
    assert not run.leftovers() and not processes_of(run_dir)


def test_a_detached_slurm_run_outlives_its_killed_nbddp_run_and_is_attached_again(tmp_path, cli_run, slurm_env):
    """``--detach``: the job's watcher belongs to the run's supervisor, not to the terminal; a new ``nbddp attach``
    shows the whole run (the queue's lines too) and its ending."""
    slow = train_cell(8).replace("    print('epoch'", "    time.sleep(3)\n    print('epoch'")
    write_notebook(tmp_path / "fit.ipynb", [code(SETUP), code(slow), code(EVALUATE)])
    front = cli_run(["run", "fit.ipynb", *CPU2, "--detach"], tmp_path)
    front.wait_for("[rank 1] epoch 0")
    os.killpg(front.proc.pid, signal.SIGKILL)  # the SSH session is gone
    front.wait()
    run_dir = only_run_dir(tmp_path)
    (job,) = slurm_env.queue()
    attached = subprocess.run(["nbddp", "attach", str(run_dir)], capture_output=True, text=True, timeout=300)
    output = attached.stdout + attached.stderr
    assert attached.returncode == 0, output
    assert f"slurm job {job}: running on" in output and "[rank 1] epoch 0" in output and "[rank 1] epoch 2" in output
    assert "succeeded in" in output and "kernel sees weight sum" in (run_dir / "output.ipynb").read_text()
    assert_matches(run_dir / "weights.pt", batch=16)
    assert json.loads((run_dir / "result.json").read_text())["slurm_job"]["state"] == "COMPLETED"
    assert not processes_of(run_dir)


def test_the_doctor_asks_slurms_controller_and_leaves_the_ranks_checks_to_the_nodes(tmp_path, cli_run, slurm_env):
    run = cli_run(["doctor", *CPU2, "--json"], tmp_path)
    assert run.wait(60) == 0, run.output
    report = json.loads(run.output[run.output.index("{"):])
    found = {check["check"]: check for check in report["checks"]}
    assert found["endpoint"]["state"] == "ok" and found["endpoint"]["line"].startswith("Slurm answers: partitions ")
    assert found["allreduce"]["state"] == "skipped" and "Slurm's nodes" in found["allreduce"]["line"]
    stopped = {**slurm_env.env, "SLURM_CONF": str(tmp_path / "no-such-slurm.conf"),  # (a controller nobody runs)
               "NBDDP_DOCTOR_TIMEOUT": "3"}  # (sinfo retries a minute: the check's limit cuts it)
    run = cli_run(["doctor", *CPU2, "--check", "endpoint"], tmp_path, env=stopped)
    assert run.wait(60) == 1, run.output
    assert "FAIL  endpoint  Slurm's controller does not answer in 3 s (sinfo: " in run.output
    assert "no-such-slurm.conf" in run.output and "Fix: check SLURM_CONF and that slurmctld runs" in run.output
    assert "(sinfo: sinfo:" not in run.output


# Slurm's time limits: three runs of 1-minute jobs, each waiting a minute or more for Slurm's time-limit check.
# They are started together (the partition oversubscribes) by one fixture, the first of their tests to run, and
# each test waits for its own: the three minutes pass once. They come last, after every test with a queue of its own.

@pytest.fixture(scope="module")
def time_limited(slurm, tmp_path_factory):
    """``{name: (run, folder)}``: the three time-limited runs, started at once, with Slurm's commands in their env."""
    runs = {}
    notebooks = {"limit": [code(SETUP), SLOW],
                 "near": [code(SETUP), code(resumable_train_cell(8, 15)), code(EVALUATE)],
                 "bound": [code(SETUP), code(resumable_train_cell(8, 15, epochs=10))]}
    flags = {"limit": [], "near": [], "bound": ["--max-requeues", "1"]}
    for name, cells in notebooks.items():
        folder = tmp_path_factory.mktemp(f"time-{name}")
        write_notebook(folder / "fit.ipynb", cells)
        runs[name] = (CliRun(["run", "fit.ipynb", *CPU2, "--time", "1", *flags[name]], folder, env=slurm.env), folder)
    yield runs
    for run, _ in runs.values():
        kill_group(run.proc.pid)
        run.leftovers(grace=0)
    slurm.wait_until_empty(30, "no time-limited run left a job in the queue")


def test_slurms_time_limit_is_reported_as_such(time_limited):
    run, folder = time_limited["limit"]  # Slurm counts whole minutes: --time 1
    assert run.wait(300) == 1, run.output
    assert "Slurm stopped job" in run.output and "at its time limit (00:01:00)" in run.output
    assert "It was not requeued: the training saves no checkpoint to resume from" in run.output
    result = json.loads((only_run_dir(folder) / "result.json").read_text())
    assert result["slurm_job"]["state"] == "TIMEOUT"
    assert not run.leftovers() and not processes_of(only_run_dir(folder))


def test_near_its_time_limit_a_job_stops_at_a_checkpoint_requeues_itself_and_finishes(time_limited):
    """--time 1: Slurm signals the job (B:USR2, 120 s before the limit: at once), every rank stops at its
    next save, the job requeues itself; each attempt trains on until the weights are an uninterrupted run's."""
    run, folder = time_limited["near"]
    assert run.wait(420) == 0, run.output
    output, run_dir = run.output, only_run_dir(folder)
    # Slurm signals within its next time-limit check (seconds to half a minute): after the first save or later
    stopped = re.search(r"Slurm signalled the job \(time limit near, or preemption\): every rank saved at this "
                        r"checkpoint \(epoch=(\d)\) and stops", output)
    assert stopped, output
    epoch = stopped.group(1)
    assert f"requeued after Slurm's signal: every rank saved at its checkpoint (epoch={epoch}) → attempt 2" in output
    assert f"[rank 1] [nbddp] attempt 2: resumed from resume.pt (epoch={epoch})" in output
    assert_matches(run_dir / "weights.pt", batch=16)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "succeeded" and result["slurm_job"]["state"] == "COMPLETED"
    assert len(result["slurm_job"]["attempts"]) == result["restarts"] + 1 >= 2
    assert "#SBATCH --signal=B:USR2@120" in (run_dir / "slurm" / "job.sbatch").read_text()
    assert not run.leftovers() and not processes_of(run_dir)


def test_the_requeue_bound_is_kept_and_the_run_fails_saying_so(time_limited):
    """Ten 15-second epochs: no attempt of a 1-minute job gets through them, so the second stops too."""
    run, folder = time_limited["bound"]
    assert run.wait(300) == 1, run.output
    run_dir = only_run_dir(folder)
    job = json.loads((run_dir / "slurm" / "job.json").read_text())
    assert "→ attempt 2" in run.output and "→ attempt 3" not in run.output
    assert (f"Slurm: job {job['job_id']} stopped at its checkpoint to be requeued, but it had been requeued 1 time, "
            f"the bound (--max-requeues 1); its last checkpoint stays in {run_dir}") in run.output
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and len(result["slurm_job"]["attempts"]) == 2
    assert (run_dir / "resume.pt").exists()
    assert not run.leftovers() and not processes_of(run_dir)
