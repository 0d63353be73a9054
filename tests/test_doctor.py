"""``nbddp doctor``: each machine fault made for real here (a 1 MB ``/dev/shm`` in a mount namespace, limits by
``prlimit``, a port held by a listening socket, a folder chowned to another user, an all-reduce whose rank never
joins) and diagnosed in its one line within the time bound, nothing left running; after a failed run, the ending
names the check that explains it.

GPUs can't exist here: the GPU checks meet a fake NVML (tests/fake_nvml.py, a real shared library the real ctypes
calls load), and NCCL's transport retries are a policy, unit-tested with fake attempts (said where).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from nbddp.doctor.ask import Ask
from nbddp.doctor.examine import transports
from nbddp.doctor.verdict import PROBLEM, Verdict
from tests import fake_nvml
from tests.conftest import code, wait_until, write_notebook

#: The doctor's whole time bound on a healthy machine is 10 s (BENCHMARKS.md, quiet); a check of one fault, here.
BOUND = 10.0
#: CI's lanes load both cores: a whole doctor's torch imports there took 19-24 s (CUDA torch on the newest Python),
#: more on a slower day; a bound that still tells a doctor that waits out its limits from one that doesn't.
LOADED = 60.0
#: The checks' own limit under that load (``NBDDP_DOCTOR_TIMEOUT``): a healthy machine's checks must pass, not race it.
LOADED_LIMIT = {"NBDDP_DOCTOR_TIMEOUT": "45"}


def doctor(cli_run, tmp_path, *args, env=None, prefix=()):
    """``nbddp doctor ARGS --json``: its exit code, report and wall time; asserts it left no process behind."""
    started = time.monotonic()
    run = cli_run(["doctor", *args, "--json"], tmp_path, env=env, prefix=prefix)
    code_ = run.wait(timeout=120)
    seconds = time.monotonic() - started
    assert not run.leftovers(grace=1), f"the doctor left processes: {run.output}"
    report = json.loads(run.output[run.output.index("{"):])
    return code_, report, seconds


def verdict(report, name):
    (found,) = [v for v in report["checks"] if v["check"] == name]
    return found


def test_a_healthy_machine_passes_every_check(tmp_path, cli_run):
    code_, report, seconds = doctor(cli_run, tmp_path, "--cpu", env=LOADED_LIMIT)
    assert code_ == 0 and report["ok"], report
    assert [v["check"] for v in report["checks"]] == ["versions", "gpus", "allreduce", "shm", "memlock", "files",
                                                      "folder", "loopback"]
    assert all(v["state"] == "ok" for v in report["checks"]), report
    assert report["run"] == "2 CPU processes (gloo) on this machine"
    assert "took" in verdict(report, "allreduce")["line"] and verdict(report, "versions")["found"]["torch"]
    assert seconds < LOADED


def test_the_terminal_report_is_one_line_per_check(tmp_path, cli_run):
    run = cli_run(["doctor", "--cpu", "--check", "loopback", "--check", "folder"], tmp_path)
    assert run.wait(60) == 0
    lines = run.output.strip().splitlines()
    assert lines[0] == "nbddp doctor: 2 CPU processes (gloo) on this machine"
    assert lines[1].split()[:2] == ["ok", "folder"] and lines[2].split()[:2] == ["ok", "loopback"]
    assert lines[-1].startswith("all 2 checks passed in ")


def test_a_tiny_dev_shm_is_named_with_what_it_breaks_and_the_fix(tmp_path, cli_run):
    tiny = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" "$@"']
    code_, report, seconds = doctor(cli_run, tmp_path, "--cpu", "--check", "shm", prefix=tiny)
    assert code_ == 1 and not report["ok"]
    shm = verdict(report, "shm")
    assert shm["state"] == PROBLEM
    assert shm["line"].startswith("/dev/shm has 1.0 MiB free of 1.0 MiB; about 256.0 MiB is needed, counting 2 ranks "
                                  "with 2 DataLoader workers each: DataLoader workers (num_workers > 0) die with 'Bus "
                                  "error'")
    assert "Fix: docker run --shm-size=1g (or --ipc=host)" in shm["line"]
    assert seconds < BOUND
    # ranks on the CPU without DataLoader workers put nothing there: no false alarm in a container's small /dev/shm
    code_, report, _ = doctor(cli_run, tmp_path, "--cpu", "--workers", "0", "--check", "shm", prefix=tiny)
    assert code_ == 0 and verdict(report, "shm")["line"] == (
        "/dev/shm has 1.0 MiB free; about 0 B is needed, counting 2 ranks with 0 DataLoader workers each")


def test_a_low_memlock_is_named_for_a_gpu_run_across_nodes_over_infiniband(tmp_path, cli_run, nvml):
    endpoint = f"127.0.0.1:{_free_port()}"
    gpu_nodes = ["--gpus", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint, "--check", "memlock"]
    low = ["prlimit", "--memlock=65536:65536", "--"]
    # InfiniBand, as Linux lists it, in a mount namespace of the doctor's own (an HCA can't exist here)
    with_ib = ["unshare", "-m", "sh", "-c",
               'mount -t tmpfs tmpfs /sys/class && mkdir -p /sys/class/infiniband/mlx5_0 && exec "$0" "$@"', *low]
    code_, report, seconds = doctor(cli_run, tmp_path, *gpu_nodes, env=nvml("GPU-a:0:81920:;GPU-b:0:81920:"),
                                    prefix=with_ib)
    assert code_ == 1
    assert verdict(report, "memlock")["line"].startswith(
        "locked memory is limited to 64.0 KiB, and this machine has InfiniBand/RoCE (mlx5_0): NCCL can't register its "
        "buffers for InfiniBand/RoCE or GPUDirect")
    assert "Fix: ulimit -l unlimited" in verdict(report, "memlock")["line"]
    assert seconds < BOUND
    # without InfiniBand, NCCL's sockets lock nothing: no problem
    code_, report, _ = doctor(cli_run, tmp_path, *gpu_nodes, env=nvml("GPU-a:0:81920:;GPU-b:0:81920:"), prefix=low)
    assert code_ == 0 and "no InfiniBand or RoCE device here" in verdict(report, "memlock")["line"]
    # on the CPU, gloo locks nothing: the same limit is no problem
    code_, report, _ = doctor(cli_run, tmp_path, "--cpu", "--check", "memlock",
                              prefix=["prlimit", "--memlock=65536:65536", "--"])
    assert code_ == 0 and "gloo on the CPU locks no memory" in verdict(report, "memlock")["line"]


def test_too_few_open_files_are_named(tmp_path, cli_run):
    code_, report, seconds = doctor(cli_run, tmp_path, "--cpu", "--nproc", "4", "--check", "files",
                                    prefix=["prlimit", "--nofile=256:4096", "--"])
    assert code_ == 1
    assert verdict(report, "files")["line"] == (
        "open files are limited to 256 a process; a rank with 2 DataLoader workers needs about 1024: workers fail with "
        "'Too many open files' or 'received 0 items of ancdata'. Fix: ulimit -n 1024 before starting Jupyter or nbddp")
    assert seconds < BOUND


def test_busy_and_missing_gpus_name_who_holds_them(tmp_path, cli_run, nvml):
    holder = subprocess.Popen(["sleep", "60"])  # a process of this machine that "holds" GPU 0
    try:
        busy = nvml(f"GPU-a:30720:81920:{holder.pid}@30720;GPU-b:0:81920:")
        code_, report, seconds = doctor(cli_run, tmp_path, "--gpus", "2", "--check", "gpus", env=busy)
        assert code_ == 1 and seconds < BOUND
        assert verdict(report, "gpus")["line"] == (
            f"GPU 0 (30.0 GiB of 80.0 GiB used) is in use by pid {holder.pid} (sleep, {ME}, 30.0 GiB): the run "
            "shares their memory and compute: CUDA out of memory, or a slow run. Fix: --gpus free (the GPUs nobody "
            "uses), --gpus N --wait, or ask who holds them")
        code_, report, _ = doctor(cli_run, tmp_path, "--gpus", "free", "--check", "gpus", env=busy)
        assert code_ == 0 and verdict(report, "gpus")["line"] == "2 visible; the run's 1 (1) free"
        code_, report, _ = doctor(cli_run, tmp_path, "--gpus", "4", "--check", "gpus", env=busy)
        assert code_ == 1 and verdict(report, "gpus")["line"] == (
            "--gpus 4, and 2 GPUs are visible: the run stops before it starts (exit 3). Fix: --gpus 2, or --cpu")
        code_, report, _ = doctor(cli_run, tmp_path, "--gpus", "2", "--check", "gpus",
                                  env={**busy, "CUDA_VISIBLE_DEVICES": "1"})
        assert code_ == 1 and verdict(report, "gpus")["line"].startswith(
            "--gpus 2, and 1 GPU is visible (CUDA_VISIBLE_DEVICES narrows them)")
        code_, report, _ = doctor(cli_run, tmp_path, "--check", "gpus", env=nvml(""))
        assert code_ == 0 and verdict(report, "gpus")["line"] == "none used (no GPU visible): 2 CPU processes (gloo)"
        # --wait waits for GPUs that are there: none visible is said as without it
        code_, report, _ = doctor(cli_run, tmp_path, "--gpus", "2", "--wait", "--check", "gpus", env=nvml(""))
        assert code_ == 1 and verdict(report, "gpus")["line"].startswith("--gpus 2, and no GPU is visible")
        assert report["run"] == ("the devices asked for can't be had (see gpus): examining 2 CPU processes (gloo) on "
                                 "this machine instead")
    finally:
        holder.kill()
        holder.wait()


def test_a_holders_name_is_shown_escaped_not_obeyed_by_the_terminal(tmp_path, cli_run, nvml):
    import sys

    named = subprocess.Popen([sys.executable, "-c", "import ctypes, time; ctypes.CDLL(None).prctl(15, b'\\x1b[2Jmine'); "
                              "print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)  # (15: PR_SET_NAME)
    try:
        named.stdout.readline()
        run = cli_run(["doctor", "--gpus", "1", "--check", "gpus"], tmp_path, env=nvml(f"GPU-a:1024:81920:{named.pid}@1024"))
        assert run.wait(60) == 1
        assert f"pid {named.pid} (\\x1b[2Jmine, " in run.output and "\x1b" not in run.output
    finally:
        named.kill()
        named.wait()


def test_a_driver_that_does_not_answer_is_said_and_hangs_nothing(tmp_path, cli_run, nvml):
    hung = {**nvml("GPU-a:0:81920:"), "FAKE_NVML_HANG": "1", "NBDDP_DOCTOR_TIMEOUT": "2"}
    code_, report, seconds = doctor(cli_run, tmp_path, "--check", "gpus", "--check", "loopback", env=hung)
    assert code_ == 1 and seconds < BOUND
    assert verdict(report, "gpus")["line"].startswith(
        "the driver (NVML) did not answer in 2 s when asked for the GPUs: GPU runs hang or fail as they start. Fix: ")
    assert verdict(report, "loopback")["state"] == "ok"  # (the other checks go on, on the CPU)


@pytest.mark.slow  # (torch imported by 2 ranks, then a limit waited out: the full tier)
def test_an_all_reduce_that_hangs_is_cut_at_its_limit_and_leaves_nothing(tmp_path, cli_run):
    fault = {"NBDDP_DOCTOR_FAULT": "hang", "NBDDP_DOCTOR_TIMEOUT": "3"}
    code_, report, seconds = doctor(cli_run, tmp_path, "--cpu", "--check", "allreduce", env=fault)
    assert code_ == 1
    assert verdict(report, "allreduce")["line"].startswith(
        "a 2-rank all-reduce (gloo) hung for 3 s: rank 0 waited in the all-reduce; rank 1 met the others but never "
        "reached it: runs hang at their first collective "
        "until --collective-timeout. Fix: ")
    assert seconds < LOADED  # (2 imports of torch, then its 3 s)


@pytest.mark.slow  # (torch imported by 2 ranks, then a limit waited out: the full tier)
def test_a_ctrl_c_stops_every_check_at_once(tmp_path, cli_run):
    import signal

    run = cli_run(["doctor", "--cpu"], tmp_path, env={"NBDDP_DOCTOR_FAULT": "hang", "NBDDP_DOCTOR_TIMEOUT": "60"})
    wait_until(lambda: len(_ranks_of(run)) == 2, 60, "the all-reduce's 2 ranks started", every=0.1)
    os.kill(run.proc.pid, signal.SIGINT)
    stopped = time.monotonic()
    assert run.wait(30) == 130, run.output
    assert time.monotonic() - stopped < 5
    assert "nbddp doctor: interrupted; its checks were stopped" in run.output and "Traceback" not in run.output
    assert not run.leftovers(grace=2)


def test_a_port_in_use_at_node_0_and_an_endpoint_that_does_not_answer(tmp_path, cli_run):
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen(1)
        port = held.getsockname()[1]
        code_, report, seconds = doctor(cli_run, tmp_path, "--cpu", "--nnodes", "2", "--node-rank", "0",
                                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--check", "endpoint")
    assert code_ == 1 and seconds < BOUND
    line = verdict(report, "endpoint")["line"]
    assert line.startswith(f"port {port} is in use on this machine by pid {os.getpid()} (")
    assert "node 0's rendezvous store can't listen there: the run fails as it starts. Fix: --rdzv-endpoint " \
           "127.0.0.1:" in line
    closed = _free_port()
    code_, report, _ = doctor(cli_run, tmp_path, "--cpu", "--nnodes", "2", "--node-rank", "1",
                              "--rdzv-endpoint", f"127.0.0.1:{closed}", "--check", "endpoint")
    assert code_ == 1 and verdict(report, "endpoint")["line"].startswith(
        f"node 0's store at 127.0.0.1:{closed} does not answer (Connection refused): this node can't join")
    code_, report, _ = doctor(cli_run, tmp_path, "--cpu", "--nnodes", "2", "--node-rank", "1",
                              "--rdzv-endpoint", "no-such-host.invalid:29500", "--check", "endpoint")
    assert code_ == 1 and verdict(report, "endpoint")["line"].startswith("no-such-host.invalid does not resolve")


def test_a_runs_folder_of_another_user_or_that_others_can_write(tmp_path, cli_run):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 1001, 1001)
    code_, report, seconds = doctor(cli_run, tmp_path, "--cpu", "--run-dir", "theirs/run1", "--check", "folder")
    assert code_ == 1 and seconds < BOUND
    assert verdict(report, "folder")["line"].startswith(
        f"the runs folder {theirs} belongs to uid 1001 (")
    assert verdict(report, "folder")["line"].endswith(
        ", not to you: nbddp refuses to write a run there (exit 2). Fix: --run-dir in a folder of your own")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    code_, report, _ = doctor(cli_run, tmp_path, "--cpu", "--run-dir", str(shared / "run1"), "--check", "folder")
    assert code_ == 1 and verdict(report, "folder")["line"].endswith(
        f"Fix: --run-dir in a folder of your own, or chmod go-w {shared}")
    # a run dir given that is there already is judged itself, as a run judges it
    code_, report, _ = doctor(cli_run, tmp_path, "--cpu", "--run-dir", "shared", "--check", "folder")
    assert code_ == 1 and verdict(report, "folder")["line"].startswith(f"--run-dir {shared} can be written by others")
    code_, report, _ = doctor(cli_run, tmp_path, "--cpu", "--check", "folder")
    assert code_ == 0 and verdict(report, "folder")["line"] == f"{tmp_path / 'runs'} will be made (private) in {tmp_path}"


def test_bad_options_are_refused_as_nbddp_run_refuses_them(tmp_path, cli_run):
    run = cli_run(["doctor", "--cpu", "--gpus", "2"], tmp_path)
    assert run.wait(30) == 2
    assert "nbddp: error: --cpu and --gpus contradict each other: choose one." in run.output
    run = cli_run(["doctor", "--check", "nonsense"], tmp_path)
    assert run.wait(30) == 2 and "invalid choice: 'nonsense'" in run.output


# ---------------------------------------------------------------------------------------------- NCCL's transports


def _attempts(*states):
    """A fake all-reduce (a unit test of the policy: NCCL's transports can't hang here without GPUs): the states
    its attempts end in, in order, and the environments they were asked with."""
    asked = []

    def attempt(env):
        asked.append(env)
        return Verdict("allreduce", states[len(asked) - 1], "", found={"state": states[len(asked) - 1], "seconds": 1.0})

    return attempt, asked


@pytest.mark.parametrize("states, transport, variables", [
    (("hung", "ok"), "peer-to-peer (P2P) between the GPUs", "NCCL_P2P_DISABLE=1"),
    (("hung", "hung", "ok"), "its shared-memory transport", "NCCL_SHM_DISABLE=1"),
    (("hung", "hung", "hung", "ok"), "both P2P and shared memory", "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"),
])
def test_an_nccl_hang_is_tried_again_per_transport_to_name_the_one_that_hangs(states, transport, variables):
    attempt, asked = _attempts(*states)
    found = transports(Ask(kind="cuda", nproc=2, limit=5), attempt)
    assert found.state == PROBLEM and len(asked) == len(states)
    assert found.line == (f"a 2-rank all-reduce (nccl) hangs with {transport} and works without it: runs hang at their "
                          f"first collective. Fix: export {variables} before starting Jupyter or nbddp (or set it in "
                          "the notebook's kernel spec)")


def test_where_hung_ranks_were_is_said_even_when_none_said_it():
    from nbddp.doctor.allreduce import stuck

    assert stuck({0: "reducing", 1: "met"}) == "rank 0 waited in the all-reduce; rank 1 met the others but never reached it"
    assert stuck({0: "starting", 1: "starting"}) == "ranks 0, 1 never finished importing torch"
    assert stuck({}) == "no rank said where it was"


def test_an_nccl_hang_with_every_transport_and_a_gloo_hang_are_said_as_such():
    attempt, asked = _attempts("hung", "hung", "hung", "hung")
    assert transports(Ask(kind="cuda", nproc=2, limit=5), attempt).line.startswith(
        "a 2-rank all-reduce (nccl) hangs with every transport tried") and len(asked) == 4
    attempt, asked = _attempts("hung")
    assert "hung" in transports(Ask(kind="cpu", nproc=2, limit=5), attempt).line and asked == [{}]
    attempt, asked = _attempts("ok")
    assert transports(Ask(kind="cuda", nproc=2, limit=5), attempt).state == "ok" and asked == [{}]


# ---------------------------------------------------------------------------------------------- after a failed run


@pytest.mark.slow
@pytest.mark.waits  # a collective timeout, then the doctor's: runs beside the rest in .ci/run
def test_a_run_stuck_at_its_first_collective_ends_naming_the_doctors_check(tmp_path, cli_run):
    write_notebook(tmp_path / "f.ipynb", [
        code("#| ddp\nimport time\nimport torch\nimport torch.distributed as dist\nimport nbddp"),
        code("#| ddp-train\nif nbddp.rank() == 1:\n    time.sleep(600)\nelse:\n    dist.all_reduce(torch.ones(1))")])
    fault = {"NBDDP_DOCTOR_FAULT": "hang", "NBDDP_DOCTOR_TIMEOUT": "3"}  # (the doctor's own ranks hang as the run's)
    started = time.monotonic()
    run = cli_run(["run", "f.ipynb", "--cpu", "--collective-timeout", "3"], tmp_path, env=fault)
    assert run.wait(120) == 124, run.output
    assert not run.leftovers(), "a process of the run or of its doctor outlived it"
    assert ("nbddp doctor (allreduce) found the likely cause: a 2-rank all-reduce (gloo) hung for 3 s: rank 0 "
            "waited in the all-reduce") in run.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert "nbddp doctor (allreduce) found the likely cause" in json.loads((run_dir / "result.json").read_text())["error"]
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_a_data_loader_out_of_shared_memory_ends_naming_dev_shm(tmp_path, cli_run):
    write_notebook(tmp_path / "s.ipynb", [
        code("#| ddp\nimport torch\nimport nbddp\nfrom torch.utils.data import DataLoader, Dataset\n\n"
             "class Big(Dataset):\n    def __len__(self):\n        return 8\n\n"
             "    def __getitem__(self, i):\n        return torch.zeros(1 << 20)  # 4 MiB a sample"),
        code("#| ddp-train\nfor batch in DataLoader(Big(), batch_size=2, num_workers=1):\n    print(batch.shape)")])
    tiny = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" "$@"']
    run = cli_run(["run", "s.ipynb", "--cpu"], tmp_path, prefix=tiny)
    assert run.wait(120) == 1, run.output
    # (a DataLoader worker notices its rank gone at its next 5 s check: the launcher stops what a rank left in its
    # session as it sees the rank end; once in CI, one process of this run outlived it by 3 s, not identified)
    assert not run.leftovers(grace=6)
    assert "No space left on device" in run.output  # (the worker's own error, as torch says it)
    assert "checking this machine for the cause: nbddp doctor --check shm (Ctrl-C skips it)" in run.output
    assert ("nbddp doctor (shm) found the likely cause: /dev/shm has 1.0 MiB free of 1.0 MiB; about 256.0 MiB is "
            "needed, counting 2 ranks with 2 DataLoader workers each") in run.output


@pytest.mark.slow
def test_ddp_doctor_in_a_kernel_names_the_gpu_memory_the_kernel_holds(tmp_path, nvml, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    for name, value in nvml("GPU-a:2048:81920:parent@2048").items():  # (the kernel holds 2 GiB of GPU 0)
        monkeypatch.setenv(name, value)
    nb = write_notebook(tmp_path / "d.ipynb", [
        code("%load_ext nbddp"), code("%ddp_doctor --cpu --check folder --check loopback"),
        code("import os\nprint(os.getpid())"), code("%ddp_doctor --gpus 1 --check gpus")])
    book = nbformat.read(nb, as_version=4)
    NotebookClient(book, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    shown = ["".join(output.get("text", "") for output in cell.outputs) for cell in book.cells]
    assert shown[1].startswith("nbddp doctor: 2 CPU processes (gloo) on this machine\n")
    assert "  ok    loopback  127.0.0.1 answers" in shown[1] and "all 2 checks passed in" in shown[1]
    kernel = int(shown[2])
    assert (f"FAIL  gpus  this kernel (pid {kernel}) holds 2.0 GiB on GPU 0: CUDA was initialised in the notebook's "
            "own process: the ranks get that much less memory") in shown[3]


# ---------------------------------------------------------------------------------------------- helpers

#: This user's name, as a holder of a GPU is named.
ME = __import__("pwd").getpwuid(os.getuid()).pw_name


def _ranks_of(run) -> list[int]:
    """The doctor's all-reduce ranks among a run's processes, alive now."""
    import psutil

    found = []
    for pid in run.seen:
        try:
            if "nbddp.doctor.allreduce" in " ".join(psutil.Process(pid).cmdline()):
                found.append(pid)
        except psutil.Error:
            pass
    return found



def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def _nvml_library(tmp_path_factory) -> Path:
    return fake_nvml.build(tmp_path_factory.mktemp("nvml"))


@pytest.fixture
def nvml(_nvml_library):
    """The environment in which a process meets the GPUs ``FAKE_NVML`` describes."""
    return lambda gpus: fake_nvml.environment(_nvml_library, gpus)


# ---------------------------------------------------------------------------------------------- which check explains


def _judged(errors=(), **fields):
    """A judged failure (a unit test of the table: the runs that end this way are the tests above and
    test_faults.py's, test_nodes.py's)."""
    from nbddp.contracts.rundir import RunDir
    from nbddp.job.outcome import Evidence, judge
    from nbddp.job.record import RankError

    made = tuple(RankError(rank, kind, message, 3, 5, "nb.ipynb, cell 3, line 5", "x = f()", "", 0.0)
                 for rank, kind, message in errors)
    evidence = Evidence(**{"run_dir": RunDir(Path("/runs/r1")), "notebook": "nb.ipynb", "launcher_exit": 1,
                           "errors": made, "collective_timeout": 5.0, **fields})
    return judge(evidence), evidence


@pytest.mark.parametrize("errors, fields, node_rank, check", [
    ([(0, "RuntimeError", "[gloo/pair.cc:1] Timed out waiting 5000ms for recv operation to complete")], {}, None,
     "allreduce"),
    ([(1, "DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error")], {}, None, "allreduce"),
    ([], {"rank_exit_codes": {1: -7}}, None, "shm"),  # SIGBUS
    ([(0, "RuntimeError", "DataLoader worker (pid 9) is killed by signal: Bus error.")], {}, None, "shm"),
    ([(0, "RuntimeError", "received 0 items of ancdata")], {}, None, "files"),
    ([], {"rendezvous_failure": "node 0's rendezvous never answered"}, 1, "endpoint"),
    ([], {"rendezvous_failure": "only 1 of 2 nodes joined the rendezvous"}, 0, None),  # (node 0 can't see node 1)
    ([(0, "DistNetworkError", "The server socket has failed to listen on any local network address: "
                              "Address already in use")], {}, None, "loopback"),
    ([(0, "ValueError", "diverged")], {}, None, None),  # the code's own error: no machine check
    ([(0, "RuntimeError", "Timed out waiting 5000ms for recv")], {"interrupted_by": 2}, None, None),  # a Ctrl-C
])
def test_the_check_that_explains_a_failure(errors, fields, node_rank, check):
    from nbddp.job.diagnosis import explaining_check

    outcome, evidence = _judged(errors, **fields)
    assert explaining_check(outcome, evidence, node_rank) == check
