"""The launcher seam: commands, and reading each launcher's own failure report."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nbddp.contracts.interpreter import module_argv

from nbddp.contracts.devices import Devices
from nbddp.contracts.errors import UsageError

from nbddp.job.lifecycle import node_gone
from nbddp.job.lifecycle import JobSpec
from nbddp.launchers import launcher_for as launcher_for_spec
from nbddp.notebook.script import Script
from nbddp.contracts.sourcemap import SourceMap
from nbddp.launchers.slurm import Slurm, sbatch_script
from nbddp.launchers.slurm_watch import filesystem_type
from nbddp.plan.options import LaunchOptions, Nodes, SlurmRequest
from nbddp.contracts.rundir import RunDir

def launcher_for(engine, nodes=None, slurm=None, rdzv_timeout=300.0, max_restarts=0):
    """The seam's choice for a job of ``engine`` (a spec with an empty script)."""
    script = Script("", SourceMap("nb.ipynb", "train.py", ()), engine, ())
    launch = LaunchOptions(nodes=nodes, slurm=slurm, rdzv_timeout=rdzv_timeout, max_restarts=max_restarts)
    spec = JobSpec(script, Devices("cpu", 2), RunDir(Path("/r")), Path("/"), launch=launch)
    return launcher_for_spec(spec)


TORCHRUN = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_02:00:00
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_02:00:00
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4241)
"""


def test_one_machine_starts_its_ranks_directly_unless_it_restarts_them(tmp_path):
    """No restarts to make: nbddp's own starter (torchrun's variables, no agent: 2 s sooner); --max-restarts and
    several nodes: torchrun."""
    direct = launcher_for("torch")
    assert direct.name == "direct" and not direct.supports_restarts
    assert launcher_for("torch", max_restarts=1).name == "torchrun"
    assert launcher_for("torch", Nodes(2, 0, "h:1")).name == "torchrun"
    argv = direct.command(Path("/r/train.py"), Devices("cpu", 3), RunDir(Path("/r")), python=sys.executable)
    # (with the notebook's folder off the module path: tests/test_safe_path.py)
    assert argv == module_argv("nbddp.launchers.direct_main", "--nproc", "3", "--report", "/r/logs/launch.json",
                               "--", "/r/train.py")
    run_dir = RunDir(tmp_path)
    env = direct.environment(run_dir)
    assert env["NBDDP_STORE"] == str(run_dir.store) and env["GLOO_SOCKET_IFNAME"] and run_dir.store.is_dir()
    run_dir.logs.mkdir()
    run_dir.launch_report.write_text('{"exit_codes": {"0": 1, "1": -15}, "root_cause": 0, "stopped_by": null}')
    run_dir.launcher_log.write_text("a rank's early line\n")
    seen = direct.observe(run_dir)
    assert seen.rank_exit_codes == {0: 1, 1: -15} and seen.root_cause == 0 and seen.tail == "a rank's early line"


def test_torchrun_command_keeps_its_folder_in_the_run_dir():
    torchrun = launcher_for("torch", max_restarts=2)
    argv = torchrun.command(Path("/r/train.py"), Devices("cpu", 3), RunDir(Path("/r")), python=sys.executable,
                            max_restarts=2)
    assert argv[:len(module_argv("nbddp.launchers.torchrun_main"))] == module_argv("nbddp.launchers.torchrun_main")
    assert argv[-1] == "/r/train.py"  # torchrun's main
    assert {"--nproc-per-node=3", "--max-restarts=2", "--log-dir=/r/logs/torchrun"} <= set(argv)
    # one machine: c10d's rendezvous in a file of the run dir, not --standalone's TCPStore on every interface
    assert {"--rdzv-backend=c10d", "--rdzv-endpoint=/r/store/rendezvous", "--rdzv-conf=store_type=file",
            "--local-addr=127.0.0.1"} <= set(argv) and "--standalone" not in argv
    assert torchrun.supports_restarts and not torchrun.streams_launcher_log


def test_torchrun_report_and_root_cause():
    torchrun = launcher_for("torch", max_restarts=1)
    assert torchrun.rank_exit_codes(TORCHRUN) == {1: -9, 0: 1}
    assert torchrun.root_cause(TORCHRUN) == 0 and torchrun.root_cause("nothing here") is None
    attempts = ("E1127 07:40:01.123000 4242 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 17) "
                "local_rank: 1 (pid: 4300) of binary: /usr/bin/python3\n"
                "W1127 07:40:02.000000 4242 torch/distributed/elastic/agent/server/api.py:725] [default] Worker group "
                "FAILED. 1/1 attempts left; will restart worker group\n")
    assert torchrun.failed_attempt(attempts) == "local rank 1 exited with code 17"
    assert torchrun.failed_attempt("nothing here") is None and launcher_for("torch").failed_attempt(attempts) is None


def test_a_launcher_hands_up_what_it_observed_as_data(tmp_path):
    """The job reads a LaunchReport, never the launcher's text: each launcher's reading of its report, at once."""
    run_dir = RunDir(tmp_path)
    run_dir.logs.mkdir()
    run_dir.launcher_log.write_text("\n".join(f"noise {n}" for n in range(30)) + TORCHRUN)
    seen = launcher_for("torch", Nodes(2, 0, "h:1"), rdzv_timeout=9).observe(run_dir, expired=True)
    assert seen.rank_exit_codes == {1: -9, 0: 1} and seen.root_cause == 0 and seen.scheduler_end is None
    assert "only 1 of 2 nodes joined the rendezvous at h:1 within --rdzv-timeout 9s" in seen.rendezvous_failure
    assert seen.tail.splitlines() == TORCHRUN.splitlines()[-15:] and "noise" not in seen.tail
    assert launcher_for("torch").observe(RunDir(tmp_path / "none")) == type(seen)()  # no report: nothing seen


def test_catalyst_spawn_runs_the_script_and_reads_mp_spawn_reports():
    spawn = launcher_for("catalyst")
    assert spawn.command(Path("/r/train.py"), Devices("cpu", 2), RunDir(Path("/r")), python="py") == ["py", "/r/train.py"]
    assert not spawn.supports_restarts and spawn.streams_launcher_log
    report = ("torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGKILL\n"
              "-- Process 0 terminated with the following error:\n")
    assert spawn.rank_exit_codes(report) == {1: -9, 0: 1} and spawn.root_cause(report) is None


def test_torchrun_as_one_node_of_several_uses_the_static_rendezvous_at_node_0():
    torchrun = launcher_for("torch", Nodes(3, 2, "node0:29500"), rdzv_timeout=12.5)
    argv = torchrun.command(Path("/r/train.py"), Devices("cpu", 2), RunDir(Path("/r")), python="py")
    assert "--standalone" not in argv
    assert {"--nnodes=3", "--node-rank=2", "--rdzv-backend=static", "--rdzv-endpoint=node0:29500",
            "--rdzv-conf=timeout=13"} <= set(argv)


@pytest.mark.parametrize("rank, report, words", [
    (0, "torch.distributed.DistStoreError: Timed out after 9 seconds waiting for clients. 1/3 clients joined.",
     "only 1 of 3 nodes joined the rendezvous at h:29500 within --rdzv-timeout 9s"),
    (1, "DistNetworkError: The client socket has timed out after 8000ms while trying to connect to (h, 29500).",
     "node 0's rendezvous at h:29500 never answered within --rdzv-timeout 9s"),
    (0, "DistNetworkError: ... port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
     "the rendezvous port 29500 is already in use on node 0"),
    (0, "ValueError: something else", None),
])
def test_rendezvous_failures_are_told_as_what_to_check(rank, report, words):
    for engine in ("torch", "catalyst"):
        told = launcher_for(engine, Nodes(3, rank, "h:29500"), rdzv_timeout=9).rendezvous_failure(report)
        assert (told is None) if words is None else (words in told)
    assert launcher_for("torch").rendezvous_failure(report) is None  # one machine: no rendezvous to blame


def test_a_catalyst_node_numbers_its_ranks_after_the_nodes_before_it():
    spawn = launcher_for("catalyst", Nodes(2, 1, "h:1"))
    spawn.command(Path("/r/train.py"), Devices("cpu", 2), RunDir(Path("/r")), python="py")
    assert spawn.environment(RunDir(Path("/r"))) == {"NBDDP_NNODES": "2", "NBDDP_NODE_RANK": "1", "NBDDP_MASTER": "h:1",
                                   "NBDDP_RDZV_TIMEOUT": "300.0"}
    assert spawn.rank_exit_codes("process 1 terminated with exit code 3") == {3: 3}


def test_the_node_that_went_away_is_named_from_the_roster():
    a, b, c = ({"node": n, "ip": f"10.0.0.{n}", "host": f"h{n}"} for n in range(3))
    assert node_gone([a, b], 0, "Connection closed by peer [127.0.0.1]:5") == b  # two nodes: the other one
    assert node_gone([a, b, c], 0, "Connection closed by peer [10.0.0.2]:5506") == c
    assert node_gone([a, b, c], 0, "Connection reset by peer") is None  # nobody named: nobody blamed
    assert node_gone([], 0, "Connection closed by peer") is None


def test_the_sbatch_script_quotes_every_value_and_runs_one_torchrun_per_node():
    request = SlurmRequest(nodes=2, partition="gpu", time="1:00:00", account="acct",
                           extra=(("comment", "$(touch /tmp/x); it's"), ("qos", "high")))
    text = sbatch_script("torch", request, Devices("cuda", 4), "/runs/a b/train.py", python="/venv/bin/python",
                         rdzv_timeout=60, logs="/runs/a b/logs")
    directives = dict((shlex.split(line[len("#SBATCH "):])[0].lstrip("-").split("=", 1) + [None])[:2]
                      for line in text.splitlines() if line.startswith("#SBATCH"))
    assert directives == {"job-name": "nbddp", "nodes": "2", "ntasks-per-node": "1", "gpus-per-node": "4",
                          "output": "/runs/a b/logs/slurm-batch.log", "no-requeue": None, "partition": "gpu",
                          "time": "1:00:00", "account": "acct", "comment": "$(touch /tmp/x); it's", "qos": "high"}
    step = shlex.split(text.splitlines()[-1])
    assert step[:2] == ["srun", "--kill-on-bad-exit=1"] and step[-1] == "/runs/a b/train.py"
    assert "--nproc-per-node=4" in step and "--rdzv-backend=static" in step and "--rdzv-conf=timeout=60" in step
    lines = sbatch_script("torch", SlurmRequest(), Devices("cpu", 2), "t.py", python="p", rdzv_timeout=1,
                          job_name="nb\ntouch /tmp/pwned #").splitlines()
    assert "#SBATCH --job-name=nb_touch__tmp_pwned__" in lines and not any(line.startswith("touch") for line in lines)
    with pytest.raises(UsageError, match="line break"):
        sbatch_script("torch", SlurmRequest(), Devices("cpu", 2), "/runs/a\nb/t.py", python="p", rdzv_timeout=1)
    catalyst = sbatch_script("catalyst", SlurmRequest(), Devices("cpu", 2), "train.py", python="python3", rdzv_timeout=60)
    assert "#SBATCH --cpus-per-task=2" in catalyst and "torch.distributed.run" not in catalyst
    assert shlex.split(catalyst.splitlines()[-1])[-1] == "train.py"


def test_slurm_reads_each_nodes_report_and_the_jobs_end(tmp_path):
    run_dir = RunDir(tmp_path)
    slurm = Slurm("catalyst", SlurmRequest(nodes=2), 60)
    slurm.command(tmp_path / "train.py", Devices("cpu", 2), run_dir, python="py")
    run_dir.logs.mkdir()
    run_dir.node_log(1).write_text("process 0 terminated with signal SIGKILL\n")
    assert slurm.rank_exit_codes(slurm.report(run_dir)) == {2: -9}
    run_dir.slurm_job.write_text('{"job_id": "7", "state": "TIMEOUT", "time_limit": "00:01:00"}')
    assert "Slurm stopped job 7 at its time limit (00:01:00)" in slurm.ended_by_scheduler(run_dir)
    run_dir.slurm_job.write_text('{"job_id": "7", "state": "CANCELLED", "cancelled_by_nbddp": true}')
    assert slurm.ended_by_scheduler(run_dir) is None
    for log in run_dir.logs.iterdir():
        log.unlink()
    run_dir.launcher_log.write_text("slurm job 7: submitted\n")  # the watcher's own lines are written here
    run_dir.slurm_job.write_text('{"job_id": "7", "state": "FAILED", "nodes": "n1"}')
    assert "must be on a filesystem the nodes share" in slurm.ended_by_scheduler(run_dir)


def test_a_job_that_requeues_itself_is_submitted_to_be_signalled_and_appends_each_attempt(tmp_path):
    """The batch script's requeue part, read as text and run as a shell (Slurm's own behaviour: tests/test_slurm.py)."""
    run_dir = RunDir(tmp_path)
    own = sbatch_script("torch", SlurmRequest(max_requeues=2), Devices("cpu", 2), "t.py", python="p", rdzv_timeout=1,
                        logs=str(run_dir.logs), requeue=run_dir)
    assert {"#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=B:USR2@120"} <= set(own.splitlines())
    assert "no-requeue" not in own and "NBDDP_REQUEUE=1" in own and 'the bound (--max-requeues 2)' in own
    step = next(line for line in own.splitlines() if line.startswith("srun"))
    assert step.endswith(" &") and "--open-mode=append" in step
    plain = sbatch_script("torch", SlurmRequest(), Devices("cpu", 2), "t.py", python="p", rdzv_timeout=1)
    assert "#SBATCH --no-requeue" in plain and "--signal" not in plain and "USR2" not in plain
    # the shell's decision after its step: requeue only when every rank stopped at this attempt's checkpoint
    tail = own[own.index("step=$!"):].replace('scontrol requeue "$SLURM_JOB_ID"', "echo REQUEUE")
    tail = tail.replace("sleep 300 & wait $!", ":")
    for saved, attempt, said in ((None, 0, "EXIT 0"), ({"attempt": 0}, 0, "REQUEUE"), ({"attempt": 0}, 1, "EXIT 0"),
                                 ({"attempt": 2}, 2, "the bound (--max-requeues 2)")):
        run_dir.slurm.mkdir(exist_ok=True)
        run_dir.requeue_saved.unlink(missing_ok=True)
        if saved is not None:
            run_dir.requeue_saved.write_text(json.dumps(saved))
        script = (f"PYTHON={shlex.quote(sys.executable)}; attempt={attempt}; SLURM_JOB_ID=7; "
                  f"requeue_saved={shlex.quote(str(run_dir.requeue_saved))}; true &\n{tail}")
        done = subprocess.run(["bash", "-c", f"({script}); echo EXIT $?"], capture_output=True, text=True, timeout=30)
        assert said in done.stdout, (saved, attempt, done.stdout, done.stderr)


def test_a_requeued_jobs_report_is_its_last_attempts_and_its_end_says_why_it_was_not_requeued(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.logs.mkdir()
    run_dir.slurm.mkdir()
    run_dir.node_log(0).write_text("nbddp: attempt 1\nTraceback: SignalException\nnbddp: attempt 2\nall well\n")
    slurm = Slurm("torch", SlurmRequest(time="1"), 60, saves_checkpoints=True)
    assert slurm.requeue and "SignalException" not in slurm.report(run_dir) and "all well" in slurm.report(run_dir)
    assert "--requeue" in slurm.command(tmp_path / "t.py", Devices("cpu", 2), run_dir, python="py")  # the watcher's
    assert "--requeue" not in Slurm("torch", SlurmRequest(), 60).command(tmp_path / "t.py", Devices("cpu", 2), run_dir,
                                                                       python="py")
    run_dir.slurm_job.write_text('{"job_id": "7", "state": "TIMEOUT", "time_limit": "00:01:00"}')
    assert "no rank reached nbddp.save_checkpoint between Slurm's signal" in slurm.ended_by_scheduler(run_dir)
    assert "the training saves no checkpoint" in Slurm("torch", SlurmRequest(), 60).ended_by_scheduler(run_dir)
    assert "(--no-requeue)" in Slurm("torch", SlurmRequest(requeue=False), 60, True).ended_by_scheduler(run_dir)
    assert not Slurm("catalyst", SlurmRequest(), 60, saves_checkpoints=True).requeue
    with pytest.raises(UsageError, match="--requeue: the catalyst engine"):
        Slurm("catalyst", SlurmRequest(requeue=True), 60)
    # the ranks of attempt 0 are gone because the job is requeued, not because one left early
    run_dir.slurm_job.write_text('{"job_id": "7", "state": "RUNNING", "restarts": 0}')
    assert not slurm.between_attempts(run_dir, 0)
    run_dir.requeue_saved.write_text('{"attempt": 0}')
    assert slurm.between_attempts(run_dir, 0) and not slurm.between_attempts(run_dir, 1)
    run_dir.slurm_job.write_text('{"job_id": "7", "state": "PENDING", "restarts": 1}')
    assert slurm.between_attempts(run_dir, 1)
    # stopped at its checkpoint, then not requeued: the bound, or a requeue that failed
    run_dir.slurm_job.write_text('{"job_id": "7", "state": "FAILED", "restarts": 0}')
    assert "stopped at its checkpoint to be requeued, but it wasn't requeued (Slurm said FAILED" in \
        slurm.ended_by_scheduler(run_dir)
    run_dir.slurm_job.write_text('{"job_id": "7", "state": "FAILED", "restarts": 3, "requeue_bound": 3}')
    assert "it had been requeued 3 times, the bound (--max-requeues 3)" in slurm.ended_by_scheduler(run_dir)


def test_filesystem_type_reads_the_longest_mount_point():
    assert filesystem_type(Path("/proc/self")) == "proc"


def test_nbddp_keeps_the_rendezvous_timeout_when_torch_would_wait_longer():
    node0 = launcher_for("torch", Nodes(2, 0, "h:1"), rdzv_timeout=9)
    node1 = launcher_for("torch", Nodes(2, 1, "h:1"), rdzv_timeout=9)
    assert node0.rendezvous_failure("", expired=False) is None
    # node 0's deadline and torch's own count say the same, whichever comes first (they raced: issue 32)
    torch_said = "torch.distributed.DistStoreError: Timed out after 9 seconds waiting for clients. 1/2 clients joined."
    assert node0.rendezvous_failure("", expired=True) == node0.rendezvous_failure(torch_said)
    assert "only 1 of 2 nodes joined the rendezvous at h:1 within --rdzv-timeout 9s" in node0.rendezvous_failure(
        "", expired=True)
    four = launcher_for("torch", Nodes(4, 0, "h:1"), rdzv_timeout=9)
    assert "not all 4 nodes joined the rendezvous at h:1" in four.rendezvous_failure("", expired=True)
    assert "node 0's rendezvous at h:1 never answered" in node1.rendezvous_failure("", expired=True)


def test_the_torchrun_command_is_one_whichever_place_renders_it():
    """The launcher's argv, a Slurm job's task line and an exported script's header are renderings of one
    function: torchrun's own parser reads the same nodes, rendezvous, timeout and processes from each."""
    from torch.distributed.run import get_args_parser

    from nbddp.launchers.by_hand import local_hint, node_hint

    parser = get_args_parser()
    fields = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_conf", "nproc_per_node", "standalone")

    def read(words):
        module = "nbddp.launchers.torchrun_main" if "nbddp.launchers.torchrun_main" in words else "torch.distributed.run"
        start = words.index(module) + 1
        args = parser.parse_args(words[start:])
        return {name: getattr(args, name) for name in fields}

    nodes, devices = Nodes(2, 0, "node0:29500"), Devices("cpu", 3)
    argv = launcher_for("torch", nodes, rdzv_timeout=300.5).command(Path("/r/train.py"), devices, RunDir(Path("/r")),
                                                                     python="py")
    header = node_hint("torch", nodes, devices, "train.py", 300.5).split("   (on every node")[0]
    sbatch = sbatch_script("torch", SlurmRequest(2), devices, "train.py", python="py", rdzv_timeout=300.5)
    task = next(line for line in sbatch.splitlines() if line.startswith("srun"))
    words = shlex.split(task.replace("$SLURM_NNODES", "2").replace("$head:$port", "node0:29500"))
    inner = shlex.split(words[words.index("-c") + 1].replace("$SLURM_NODEID", "0"))  # the task's own shell
    slurm = [*inner[1:-1], *words[words.index('$PYTHON') + 1:]]
    expected = {"nnodes": "2", "node_rank": 0, "rdzv_backend": "static", "rdzv_endpoint": "node0:29500",
                "rdzv_conf": "timeout=301", "nproc_per_node": "3", "standalone": False}
    assert read(argv) == expected
    assert read(shlex.split(header.replace("--node-rank=R", "--node-rank=0"))) == expected
    assert read(slurm) == expected
    # One machine: a person's command (the header's) is torchrun's --standalone; nbddp's own launcher meets in a
    # file of the run dir instead (nbddp.launchers.private_rendezvous), with the same processes.
    one = read(shlex.split(local_hint("torch", devices, "train.py")))
    assert one["standalone"] and one["nproc_per_node"] == "3"
    ours = read(launcher_for("torch", max_restarts=1).command(Path("t.py"), devices, RunDir(Path("/r")), python="py"))
    assert ours == {**one, "standalone": False, "nnodes": "1", "rdzv_backend": "c10d",
                    "rdzv_endpoint": "/r/store/rendezvous", "rdzv_conf": "store_type=file"}


def test_ray_ranks_get_torchruns_variables_rank_0_beside_the_kernel_and_their_own_gpu():
    """The Ray driver's plan, on what two GPU nodes' actors could say (no GPU or second node here: a policy test)."""
    from nbddp.launchers.ray_main import node_order, rank_plan

    def actor(node, ip, gpus):
        return {"node": node, "ip": ip, "gpus": gpus, "port": 4000 + len(ip), "missing": []}

    where = [[actor("far", "10.0.0.9", ["3"]), actor("far", "10.0.0.9", ["10"])],  # placed first, but not here
             [actor("here", "10.0.0.1", ["9"]), actor("here", "10.0.0.1", ["2"])]]
    order = node_order(where, here="here")
    assert order == [1, 0]
    plan = rank_plan(where, order, gpus=True, forwarded={"NCCL_DEBUG": "INFO"})
    by_rank = {rank: (node, index, env) for node, index, rank, env in plan}
    assert sorted(by_rank) == [0, 1, 2, 3]
    node, index, env = by_rank[0]  # the driver's node holds ranks 0-1; its GPU 2 is local rank 0
    assert (node, index, env["GROUP_RANK"], env["LOCAL_RANK"]) == (1, 1, "0", "0")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,9" and env["MASTER_ADDR"] == "10.0.0.1"
    assert by_rank[1][2]["LOCAL_RANK"] == "1" and by_rank[1][1] == 0
    node, index, env = by_rank[2]  # "10" after "3": numeric order, not text order
    assert (node, index, env["CUDA_VISIBLE_DEVICES"], env["LOCAL_RANK"]) == (0, 0, "3,10", "0")
    assert all(e["WORLD_SIZE"] == "4" and e["GROUP_WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2"
               and e["MASTER_PORT"] == "4008" and e["NCCL_DEBUG"] == "INFO" and e["OMP_NUM_THREADS"] == ""
               for _, _, _, e in plan)
    cpu = rank_plan([[actor("n", "h", []), actor("n", "h", [])]], [0], gpus=False, forwarded={"OMP_NUM_THREADS": "4"})
    assert [(index, env["RANK"], env["OMP_NUM_THREADS"]) for _, index, _, env in cpu] == [(0, "0", "4"), (1, "1", "4")]
    assert all("CUDA_VISIBLE_DEVICES" not in env for _, _, _, env in cpu)
