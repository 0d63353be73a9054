"""Fault injection: each test a row of docs/reliability.md, with real processes, checked by PID.

Every test asserts the exit code, the message, and that no process of the run is left. The runs ask for
CPU ranks (``--cpu``: 2 gloo processes, on a machine with GPUs too).
"""

import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from unittest import mock

import pytest

from tests.conftest import code, write_notebook

pytestmark = pytest.mark.slow

SETUP = "#| ddp\nimport os, sys, time, signal\nimport torch\nimport torch.distributed as dist\nimport nbddp\nmodel = torch.nn.Linear(2, 2)"


def training(body: str):
    return [code(SETUP), code("#| ddp-train\nmodel = nbddp.prepare(model)\n" + body), code("print('EVALUATION RAN')")]


def result_of(folder):
    (run_dir,) = (folder / "runs").iterdir()
    return json.loads((run_dir / "result.json").read_text())


def run_faulty(tmp_path, cli_run, body, *args, timeout=120):
    write_notebook(tmp_path / "f.ipynb", training(body))
    run = cli_run(["run", "f.ipynb", "--cpu", *args], tmp_path)
    code_ = run.wait(timeout=timeout)
    assert "EVALUATION RAN" not in run.output
    assert not run.leftovers(), "a process of the run outlived it"
    return code_, run.output


LOOP = "for step in range(1000):\n    {fault}\n    dist.all_reduce(torch.ones(1))\n    time.sleep(0.05)"


@pytest.mark.parametrize("fault, named", [
    ("if step == 3 and nbddp.rank() == 1: os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL (often the kernel's out-of-memory killer)"),
    ("if step == 3 and nbddp.rank() == 1: __import__('ctypes').string_at(0)", "killed by SIGSEGV (a crash in native code)"),
])
def test_rank_killed_by_a_signal_is_named(tmp_path, cli_run, fault, named):
    exit_code, output = run_faulty(tmp_path, cli_run, LOOP.format(fault=fault))
    assert exit_code == 1, output
    assert f"rank 1 died: {named}" in output


def test_rank_that_finished_then_crashed_while_exiting_is_told_truthfully(tmp_path, cli_run):
    """The done mark was written, then the process aborted at exit: a defect, said as such; weights kept."""
    body = "dist.all_reduce(torch.ones(1))\nif nbddp.rank() == 1:\n    import atexit\n    atexit.register(os.abort)"
    exit_code, output = run_faulty(tmp_path, cli_run, body)
    assert exit_code == 1, output
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "ranks" / "rank-1.done").exists()
    assert "rank 1 finished training, then crashed while exiting (SIGABRT)" in output
    assert f"The trained weights are kept in {run_dir / 'weights.pt'}" in output
    assert (run_dir / "weights.pt").exists() and result_of(tmp_path)["status"] == "failed"
    assert "rank 1 died" not in output


def test_rank_exiting_0_early_is_a_failure_not_a_hang(tmp_path, cli_run):
    started = time.monotonic()
    exit_code, output = run_faulty(tmp_path, cli_run, LOOP.format(fault="if step == 3 and nbddp.rank() == 1: os._exit(0)"))
    assert exit_code == 1, output
    assert "rank 1 ended before the training finished, without an error" in output
    assert time.monotonic() - started < 60


@pytest.mark.waits  # mostly a timeout or a mid-training signal: runs beside the rest in .ci/run
def test_rank_stuck_in_a_collective_fails_within_the_collective_timeout(tmp_path, cli_run):
    body = ("if nbddp.rank() == 1:\n    time.sleep(600)  # skips the all_reduce below\n"
            "else:\n    dist.all_reduce(torch.ones(1))")
    started = time.monotonic()
    exit_code, output = run_faulty(tmp_path, cli_run, body, "--collective-timeout", "5")
    assert exit_code == 124, output
    assert "a collective timed out (--collective-timeout 5s): rank 0 waited for peers" in output
    assert "f.ipynb, cell 2, line 6" in output  # the all_reduce rank 0 was stuck in
    assert "nbddp doctor (allreduce) finds nothing wrong here (a 2-rank all-reduce (gloo) took " in output
    assert "s): the cause is likely in the run itself" in output  # (the doctor's own all-reduce worked)
    assert time.monotonic() - started < 90  # (5 s, the doctor's all-reduce, start-up under CI's load)
    assert result_of(tmp_path)["status"] == "timeout"


@pytest.mark.waits  # mostly a timeout or a mid-training signal: runs beside the rest in .ci/run
def test_hang_outside_collectives_stops_after_idle_timeout(tmp_path, cli_run):
    body = "print('loading', flush=True)\ntime.sleep(600)  # a stuck data loader"
    started = time.monotonic()
    exit_code, output = run_faulty(tmp_path, cli_run, body, "--idle-timeout", "4")
    assert exit_code == 124, output
    assert "no rank printed or logged anything for 4s (--idle-timeout)" in output
    assert time.monotonic() - started < 60


def test_launcher_killed_ranks_exit_on_their_own(tmp_path, cli_run):
    """SIGKILL to nbddp itself: no cleanup code runs; the guard's parent-death signal must do it."""
    write_notebook(tmp_path / "f.ipynb", training("for step in range(100000):\n    print('step', step, flush=True)\n    time.sleep(0.1)"))
    # Its own temp folder (short: a socket's path has a length limit), so that another nbddp process's clean-up of
    # the temp folder can't race this test's.
    temp = Path(tempfile.mkdtemp(prefix="f", dir="/tmp"))
    run = cli_run(["run", "f.ipynb", "--cpu"], tmp_path, env={"TMPDIR": str(temp)})
    run.wait_for("[rank 1] step 2")
    ranks = set(run.seen)
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait(10)
    assert not run.leftovers(grace=10), "ranks outlived a SIGKILLed launcher"
    assert ranks
    # It had no chance to remove its kernel's socket folder; the next run removes it.
    from nbddp.doors.notebook_kernel import SOCKETS_PREFIX
    from nbddp.contracts.process_groups import owned_temp_dir

    [left] = temp.glob(f"{SOCKETS_PREFIX}{run.proc.pid}-*")
    with mock.patch.object(tempfile, "tempdir", str(temp)):
        fresh = owned_temp_dir(SOCKETS_PREFIX)
    assert not left.exists() and os.path.isdir(fresh)
    os.rmdir(fresh)
    shutil.rmtree(temp)  # (what else the SIGKILLed run left there: torch's compile cache folder)


def test_busy_default_ports_and_a_stale_run_dir(tmp_path, cli_run):
    """torchrun's default 29500 and Catalyst's 2112 taken: runs pick free ports. A used run dir: exit 2."""
    import socket

    listeners = []
    for port in (29500, 2112):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            s.listen()
            listeners.append(s)
        except OSError:
            pass  # already busy: even better
    try:
        write_notebook(tmp_path / "f.ipynb", training("dist.all_reduce(torch.ones(1))"))
        run = cli_run(["run", "f.ipynb", "--cpu", "--run-dir", "r1"], tmp_path)
        assert run.wait() == 0, run.output
        mode = (tmp_path / "r1" / "train.py").stat().st_mode
        assert not mode & 0o022 and (tmp_path / "r1").stat().st_mode & 0o777 == 0o700
        again = cli_run(["run", "f.ipynb", "--cpu", "--run-dir", "r1"], tmp_path)
        assert again.wait() == 2 and "already holds a run" in again.output
        zero = cli_run(["run", "f.ipynb", "--cpu", "--nproc", "0"], tmp_path)
        assert zero.wait() == 2 and "--nproc 0: need at least 1 process" in zero.output  # a bad value, not a device problem
    finally:
        for s in listeners:
            s.close()


def test_ps_lists_a_live_run_and_kill_ends_it(tmp_path, cli_run):
    write_notebook(tmp_path / "f.ipynb", training("for step in range(100000):\n    print('step', step, flush=True)\n    time.sleep(0.1)"))
    run = cli_run(["run", "f.ipynb", "--cpu"], tmp_path)
    run.wait_for("[rank 1] step 2")
    (run_dir,) = (tmp_path / "runs").iterdir()
    ps = cli_run(["ps"], tmp_path)
    assert ps.wait() == 0 and run_dir.name in ps.output and "torch" in ps.output
    # The run dir as the run prints it (relative to where nbddp was started), from that folder
    printed = re.search(r"run dir (\S+)", run.output).group(1)
    kill = cli_run(["kill", f"runs/{run_dir.name}"], tmp_path)
    assert printed.endswith(f"runs/{run_dir.name}")
    assert kill.wait(timeout=30) == 0 and f"stopped {run_dir.name}" in kill.output
    assert run.wait(timeout=30) == 143
    assert not run.leftovers(grace=1)
    assert result_of(tmp_path)["status"] == "interrupted"
    after = cli_run(["ps"], tmp_path)
    assert after.wait() == 0 and "no live runs" in after.output
    unknown = cli_run(["kill", "nope"], tmp_path)
    assert unknown.wait() == 2 and "no live run 'nope'" in unknown.output


CATALYST = (
    "#| ddp\nimport torch\nfrom torch.utils.data import DataLoader, TensorDataset\nfrom catalyst import dl\n"
    "X, y = torch.randn(64, 4), torch.randint(0, 2, (64,))\n"
    "model = torch.nn.Linear(4, 2)\n"
    "class Boom(dl.Callback):\n"
    "    def __init__(self):\n"
    "        super().__init__(order=dl.CallbackOrder.External)\n"
    "    def on_batch_end(self, runner):\n"
    "        if runner.engine.process_index == 1 and runner.batch_step >= 3 and BOOM:\n"
    "            raise ValueError('catalyst rank broke')\n"
)
CATALYST_TRAIN = (
    "#| ddp-train\nrunner = dl.SupervisedRunner()\n"
    "runner.train(model=model, criterion=torch.nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),\n"
    "             loaders=loaders, num_epochs=2, callbacks=[Boom()], verbose=False)"
)


@pytest.mark.beside  # (a Catalyst run, 34 CPU-s, asserting no timing: beside the main lane, where the lanes even out)
def test_catalyst_rank_raising_names_cell_line_and_rank(tmp_path, cli_run):
    loaders = "loaders = {'train': DataLoader(TensorDataset(X, y), batch_size=8)}"
    write_notebook(tmp_path / "c.ipynb", [code("BOOM = True", "parameters"), code(CATALYST + loaders), code(CATALYST_TRAIN),
                                          code("print('EVALUATION RAN')")])
    run = cli_run(["run", "c.ipynb", "--cpu"], tmp_path)
    assert run.wait() == 1, run.output
    assert "rank 1 raised ValueError: catalyst rank broke" in run.output
    assert "c.ipynb, cell 2, line 12" in run.output and "EVALUATION RAN" not in run.output
    assert not run.leftovers()


def test_catalyst_lambda_that_spawn_must_pickle_is_named_before_the_ranks_start(tmp_path, cli_run):
    loaders = "loaders = {'train': DataLoader(TensorDataset(X, y), batch_size=8,\n                         collate_fn=lambda b: torch.utils.data.default_collate(b))}"
    write_notebook(tmp_path / "c.ipynb", [code("BOOM = False", "parameters"), code(CATALYST + loaders), code(CATALYST_TRAIN)])
    run = cli_run(["run", "c.ipynb", "--cpu"], tmp_path)
    assert run.wait() == 2, run.output
    assert "UnpicklableError: c.ipynb, cell 2, line 14: Catalyst's DDP engine sends the runner" in run.output
    assert "runner._loaders['train'].collate_fn (function) can't be pickled" in run.output
    assert not list((tmp_path / "runs").glob("*/logs/rank-*.log"))  # no rank ever started
    assert not run.leftovers()


def test_max_restarts_resumes_from_the_last_checkpoint(tmp_path, cli_run):
    body = (
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "done = nbddp.restore(model=model, optimizer=opt)\n"
        "start = done.get('epoch', -1) + 1\n"
        "print('attempt', nbddp.restart_count(), 'starts at epoch', start, flush=True)\n"
        "for epoch in range(start, 4):\n"
        "    if epoch == 2 and nbddp.restart_count() == 0 and nbddp.rank() == 1:\n"
        "        raise RuntimeError('transient failure')\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "    nbddp.save_checkpoint(model=model, optimizer=opt, epoch=epoch)\n"
        "    nbddp.log(epoch=epoch)"
    )
    from tests.test_safe_path import plant, planted_imports

    mark = plant(tmp_path, "typing.py")  # (torchrun's launcher and the ranks it starts import nothing from the folder)
    write_notebook(tmp_path / "f.ipynb", training(body)[:2])
    run = cli_run(["run", "f.ipynb", "--cpu", "--max-restarts", "1"], tmp_path)
    assert run.wait(timeout=120) == 0, run.output
    assert planted_imports(mark) == ""
    assert "[rank 0] attempt 0 starts at epoch 0" in run.output
    assert "[rank 0] attempt 1 starts at epoch 2" in run.output and "resumed from resume.pt" in run.output
    said = ("[launcher] restart 1 of 1 (--max-restarts): rank 1 raised RuntimeError: transient failure; every rank "
            "starts its script again")
    assert run.output.count(said) == 1, run.output  # as it happens, once
    assert run.output.index("[rank 0] attempt 0") < run.output.index(said) < run.output.index("[rank 0] attempt 1")
    assert re.search(r"nbddp: succeeded in [\d.]+s after 1 restart · ", run.output), run.output
    result = result_of(tmp_path)
    assert result["status"] == "succeeded" and result["restarts"] == 1 and result["final_metrics"]["epoch"] == 3
    assert not run.leftovers()


def test_bad_parameter_names_are_refused_before_anything_runs(tmp_path, cli_run):
    write_notebook(tmp_path / "f.ipynb", [code("lr = 0.1", "parameters")] + training("pass"))
    run = cli_run(["run", "f.ipynb", "-p", "x=1\nimport os#", "1"], tmp_path)
    assert run.wait() == 2 and "not a valid Python variable name" in run.output
    keyword = cli_run(["run", "f.ipynb", "-p", "class", "1"], tmp_path)
    assert keyword.wait() == 2
    assert not (tmp_path / "runs").exists()
