"""Detached runs (nbddp/doors/detached.py): a supervisor owns the ranks, so the terminal or kernel that started
the run may die; ``attach`` shows the whole run and brings its weights back; ``kill`` leaves nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from nbddp.contracts.atomic import write_json
from nbddp.doors import detached
from nbddp.contracts.errors import RunFailed, UsageError
from nbddp.contracts.rundir import RunDir
from tests.conftest import alive, code, wait_until, write_notebook
from tests.test_trackers import assert_one_record, writes_on_every_rank
from tests.linear_fit import EPOCHS, EVALUATE, SETUP, reference, train_cell

BATCH = 8  # per rank: the world's batch is 16
#: Slow enough to kill the front door between two epochs.
SLOW_TRAIN = train_cell(BATCH).replace("    print('epoch'", "    time.sleep(2)\n    print('epoch'")


@pytest.fixture(autouse=True)
def no_supervisor_left(tmp_path):
    """A failed test must not leave a detached run training beside the next ones (nobody's child: no group to kill)."""
    yield
    for info in tmp_path.glob("runs/*/detached/supervisor.json"):
        for pid in _supervised(info.parents[1]):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _supervised(run_dir: Path) -> set[int]:
    """The supervisor and every process under it."""
    pid = json.loads(RunDir(run_dir).supervisor.read_text())["pid"]
    try:
        supervisor = psutil.Process(pid)
        if "nbddp.doors.detached" not in supervisor.cmdline():  # (a test's made-up record: never signal it)
            return set()
        return {pid} | {p.pid for p in supervisor.children(recursive=True)}
    except psutil.Error:
        return set()


def _gone_within(pids, seconds, what: str) -> None:
    """Every one of ``pids`` ends within ``seconds`` (``what`` names it), or the test fails naming those left."""
    wait_until(lambda: not any(alive(p) for p in pids), seconds, what,
               detail=lambda: f"still alive: {sorted(p for p in pids if alive(p))}")


def _wait_for_line(run_dir: Path, text: str, seconds: float = 120) -> None:
    log = RunDir(run_dir).rank_log(1)
    wait_until(lambda: log.exists() and text in log.read_text(errors="replace"), seconds, f"{text!r} in {log}")


def _start_long_detached_run(tmp_path, cli_run):
    """``nbddp run --detach`` of a 100-epoch training, once its first epoch is done: the front door, the run dir,
    and the supervisor's processes."""
    nb = write_notebook(tmp_path / "nb.ipynb", [code(SETUP), code(SLOW_TRAIN.replace(f"range({EPOCHS})", "range(100)"))])
    front = cli_run(["run", nb, "--cpu", "--detach"], tmp_path)
    front.wait_for("epoch 0 rank 1")
    run_dir = _one_run_dir(tmp_path)
    return front, run_dir, _supervised(run_dir)


def _kernel_weight(kernel) -> torch.Tensor:
    out = kernel.execute("import json; print('W=' + json.dumps(model.weight.tolist()))")
    return torch.tensor(json.loads(out.split("W=", 1)[1].splitlines()[0]))


def _nbddp(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nbddp", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def _one_run_dir(folder: Path) -> Path:
    wait_until(lambda: (folder / "runs").is_dir() and any((folder / "runs").iterdir()), 60,
               f"a run dir under {folder / 'runs'}")
    (run_dir,) = (folder / "runs").iterdir()
    return run_dir


# --- the supervisor's contract, without a run ------------------------------------------------------------------

def test_only_detached_runs_can_be_attached_and_a_missing_one_is_named(tmp_path):
    plain = tmp_path / "runs" / "nb-1"
    (plain / "logs").mkdir(parents=True)
    with pytest.raises(UsageError, match="not a detached run.*--detach"):
        detached.find_run(str(plain), tmp_path)
    with pytest.raises(UsageError) as missing:  # (attach replays ended runs too: not only `nbddp ps`'s live ones)
        detached.find_run("nb-2", tmp_path)
    assert str(missing.value) == (f"no run 'nb-2': give a detached run's folder (as its start line printed it: "
                                  f"runs/NAME beside its notebook), or its name under {tmp_path / 'runs'}; `nbddp ps` "
                                  "lists the runs alive now.")
    with pytest.raises(UsageError, match="no detached run of nb.ipynb"):
        detached.latest(tmp_path / "nb.ipynb")
    result = _nbddp("attach", plain, cwd=tmp_path)
    assert result.returncode == 2 and "not a detached run" in result.stderr, result.stderr


def test_a_supervisor_gone_without_a_result_is_said_not_waited_for(tmp_path):
    """A SIGKILLed supervisor takes its ranks with it (parent death) and can't write result.json; a process
    that was given its pid since is not taken for it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    paths = RunDir(tmp_path)
    paths.detached.mkdir()
    write_json(paths.supervisor, {"pid": dead.pid, "started": time.time()})
    with pytest.raises(RunFailed, match=f"supervisor \\(pid {dead.pid}\\) is gone and left no result"):
        detached.follow(paths, [])
    write_json(paths.supervisor, {"pid": os.getpid(), "created": 0.0})  # a live process that got its pid since
    with pytest.raises(RunFailed, match=f"supervisor \\(pid {os.getpid()}\\) is gone"):
        detached.replay(paths, lambda text: None)
    write_json(paths.supervisor, {"pid": os.getpid(), "error": "no GPU here: use --cpu"})
    with pytest.raises(RunFailed, match="ended before it started: no GPU here"):
        detached.follow(paths, [])


def test_a_run_the_supervisor_refuses_is_said_by_the_attacher(tmp_path):
    """A real supervisor, whose notebook is gone by the time it runs: it records why, and exits."""
    from nbddp.doors.notebook_run import RunOptions
    from nbddp.plan.options import LaunchOptions

    run_dir = tmp_path / "runs" / "gone-1"
    run_dir.mkdir(parents=True)
    pid = detached.start(RunOptions(tmp_path / "gone.ipynb", LaunchOptions(run_dir=run_dir)), RunDir(run_dir), tmp_path)
    assert pid != os.getpid()
    with pytest.raises(RunFailed, match="ended before it started: .*gone.ipynb"):
        detached.follow(RunDir(run_dir), [])
    result = _nbddp("attach", run_dir, cwd=tmp_path)
    assert result.returncode == 1 and "ended before it started" in result.stderr, result.stderr


def test_the_request_and_the_error_cross_as_data_and_come_back_equal(tmp_path):
    """``detached/request.json`` and ``error.json`` (nbddp/doors/detached_request.py): what the door asked and the
    run's judged error, written and read back as plain data (no pickle a planted file could make run code)."""
    from nbddp.doors.detached_request import read_error, read_request, write_error, write_request
    from nbddp.doors.notebook_run import RunOptions
    from nbddp.contracts.errors import RunTimeout
    from nbddp.job.orchestrator import RunRequest
    from nbddp.notebook.reader import read_notebook
    from nbddp.notebook.script import generate
    from nbddp.plan.options import LaunchOptions, SlurmRequest

    paths = RunDir(tmp_path)
    paths.detached.mkdir()
    launch = LaunchOptions(parameters={"lr": 0.5, "shape": (2, 3), "name": "x"}, returns=("model", "opt"), cpu=True,
                           nproc=2, timeout=60.5, collective_timeout=None, slurm=SlurmRequest(extra=(("qos", "high"),)))
    options = RunOptions(tmp_path / "nb.ipynb", launch, None, "nbddp run nb.ipynb --detach")
    write_request(paths, options)
    assert read_request(paths) == options
    notebook = read_notebook(write_notebook(tmp_path / "nb.ipynb", [code("lr = 0.1", "parameters"), code(SETUP),
                                                                    code(train_cell(BATCH))]))
    script = generate(notebook, launch.export_options(parameters={"lr": 0.5}))
    request = RunRequest(script, launch, tmp_path / "nb.ipynb", tmp_path, {"lr": 0.5, "shape": (2, 3)}, {"lr": 0.5},
                         "%%ddp_train --detach", owner="detached")
    write_request(paths, request)
    assert read_request(paths) == request and isinstance(read_request(paths).parameters["shape"], tuple)
    assert b"pickle" not in paths.detached_request.read_bytes() and json.loads(paths.detached_request.read_text())
    error = RunTimeout("the run exceeded --timeout", exit_code=124, rank=1, exc_type="X", cell=3, line=2,
                       run_dir=str(tmp_path))
    write_error(paths, error)
    back = read_error(paths)
    assert type(back) is RunTimeout and str(back) == str(error)
    assert [getattr(back, name) for name in error.FIELDS] == [getattr(error, name) for name in error.FIELDS]
    paths.detached_error.write_text(json.dumps({"type": "SystemExit", "message": "x", "fields": {}}))
    assert read_error(paths) is None  # only nbddp's own errors are made from it


@pytest.mark.skipif(os.geteuid() != 0, reason="planting files as another user needs root")
def test_a_planted_request_error_or_link_is_refused_and_another_users_run_is_named(tmp_path):
    """What the issue's attacker did: a symlink planted where the request is written (it overwrote the victim's
    file), a request or error file swapped in by another user, a detached run in a shared folder attached to."""
    from nbddp.doors.detached_request import read_error, read_request, write_request
    from nbddp.doors.notebook_run import RunOptions
    from nbddp.contracts.owned import NotYours

    project = tmp_path / "project"
    paths = RunDir(project / "runs" / "nb-1")
    paths.detached.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("secret")
    paths.detached_request.symlink_to(victim)
    write_request(paths, RunOptions(tmp_path / "nb.ipynb"))  # replaces the link, never writes through it
    assert victim.read_text() == "secret" and not paths.detached_request.is_symlink()
    os.chown(paths.detached_request, 65534, 65534)  # swapped in by someone else
    with pytest.raises(NotYours, match="request .*belongs to uid 65534"):
        read_request(paths)
    paths.detached_error.write_text(json.dumps({"type": "RunFailed", "message": "planted", "fields": {}}))
    os.chown(paths.detached_error, 65534, 65534)
    assert read_error(paths) is None
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_json(paths.supervisor, {"pid": int(gone.stdout), "started": time.time()})
    os.chown(paths.path, 65534, 65534)  # a colleague's detached run beside the notebook
    with pytest.raises(NotYours, match="belongs to uid 65534.*only runs of your own"):
        detached.find_run(str(paths.path), project)
    with pytest.raises(UsageError, match="no detached run of nb.ipynb"):
        detached.latest(project / "nb.ipynb")  # (theirs is not the newest of the user's)
    for command in ("attach", "kill"):
        result = _nbddp(command, paths.path, cwd=project)
        assert result.returncode == 2 and "belongs to uid 65534" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_the_options_of_detaching_and_attaching():
    from nbddp.doors.cli import build_parser

    assert build_parser().parse_args(["run", "nb.ipynb", "--detach"]).detach
    assert not build_parser().parse_args(["run", "nb.ipynb"]).detach
    assert build_parser().parse_args(["attach", "runs/nb-1"]).run == "runs/nb-1"
    with pytest.raises(SystemExit):  # a batch has a folder of runs, not one run to detach
        build_parser().parse_args(["batch", "nb.ipynb", "--grid", "g.yaml", "--detach"])


# --- real runs ----------------------------------------------------------------------------------------------------

@pytest.mark.waits
@pytest.mark.slow
def test_a_detached_run_outlives_its_killed_nbddp_run_and_attach_shows_all_of_it(tmp_path, cli_run):
    nb = write_notebook(tmp_path / "nb.ipynb", [code(SETUP), code(SLOW_TRAIN + writes_on_every_rank(tmp_path / "tb")),
                                                code(EVALUATE)])
    front = cli_run(["run", nb, "--cpu", "--detach"], tmp_path)
    front.wait_for("epoch 0 rank 1")
    run_dir = _one_run_dir(tmp_path)
    supervised = _supervised(run_dir)
    os.killpg(front.proc.pid, signal.SIGKILL)  # the terminal goes, and the SSH session with it
    front.wait()
    _wait_for_line(run_dir, "epoch 1 rank 1")  # the training goes on without it
    assert all(alive(p) for p in supervised), "the run died with the terminal that started it"
    listed = _nbddp("ps", cwd=tmp_path).stdout
    assert run_dir.name in listed and "detached" in listed, listed

    attached = _nbddp("attach", run_dir, cwd=tmp_path)
    out = attached.stdout + attached.stderr
    assert attached.returncode == 0, out
    assert "epoch 0 rank 1" in out and f"epoch {EPOCHS - 1} rank 1" in out, out  # earlier lines, then the new ones
    assert "[cell 3] kernel sees weight sum" in out, out  # what nbddp run's terminal shows: the cells' output too
    assert out.index("epoch 2 rank 1") < out.index("[cell 3]") < out.index("succeeded in") < out.index("output.ipynb")
    assert json.loads(RunDir(run_dir).result.read_text())["status"] == "succeeded"
    weights = torch.load(RunDir(run_dir).weights, weights_only=True)["returns"]["model"]
    for key, value in reference(2 * BATCH).items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6)
    _gone_within(supervised, 10, "the detached run's processes ended with it")
    assert_one_record(tmp_path / "tb")  # a tracker called on every rank: rank 0's record alone

    again = _nbddp("attach", run_dir.name, cwd=tmp_path)  # after the end: the whole run, at once
    assert again.returncode == 0 and again.stdout == attached.stdout, (again.stdout, attached.stdout)


@pytest.mark.waits
@pytest.mark.slow
def test_nbddp_kill_stops_a_detached_run_its_attacher_says_so_and_nothing_is_left(tmp_path, cli_run):
    front, run_dir, supervised = _start_long_detached_run(tmp_path, cli_run)
    assert len(supervised) >= 4  # the supervisor, its notebook's kernel, torchrun, two ranks
    follower = cli_run(["attach", run_dir], tmp_path)  # a second terminal follows it; Ctrl-C there stops the following
    follower.wait_for("epoch 0 rank 1")
    os.killpg(follower.proc.pid, signal.SIGINT)
    assert follower.wait(30) == 0 and "stopped following; the run goes on" in follower.output, follower.output
    assert all(alive(p) for p in supervised), "Ctrl-C while following stopped the run"
    killed = _nbddp("kill", run_dir, cwd=tmp_path)
    assert killed.returncode == 0, killed.stderr
    _gone_within(supervised, 15, "nbddp kill ended every process of the detached run")
    record = json.loads(RunDir(run_dir).result.read_text())
    assert record["status"] == "interrupted" and record["exit_code"] == 128 + signal.SIGTERM
    assert front.wait(60) == record["exit_code"], front.output  # the attached terminal says how the run ended
    assert "interrupted after" in front.output, front.output
    assert "no live runs" in _nbddp("ps", cwd=tmp_path).stdout


@pytest.mark.waits
@pytest.mark.slow
def test_a_detached_cell_outlives_its_killed_kernel_and_a_new_kernel_attaches_for_the_weights(tmp_path, monkeypatch):
    """The kernel is SIGKILLed (a restart) mid-run; a new kernel's %ddp_attach shows the earlier lines and the new
    ones and gets the weights an attached run gives; attaching after the end does the same at once."""
    from tests.test_magic import ProtocolKernel

    monkeypatch.setenv("NBDDP_VIEW", "text")
    body = SLOW_TRAIN.split("\n", 1)[1]  # without its "#| ddp-train" line
    first = ProtocolKernel(tmp_path)
    try:
        for cell in ("%load_ext nbddp", SETUP):
            first.execute(cell)
        first.start_execute(f"%%ddp_train --cpu --detach\n{body}")
        run_dir = _one_run_dir(tmp_path)
        _wait_for_line(run_dir, "epoch 0 rank 1")
        supervised = _supervised(run_dir)
        os.killpg(os.getpgid(first.km.provisioner.process.pid), signal.SIGKILL)  # a restart: the kernel's group
        first.km.provisioner.process.wait()
    finally:
        first.kc.stop_channels()
        first.km.cleanup_resources()
    _wait_for_line(run_dir, "epoch 1 rank 1")  # the training goes on without it
    assert all(alive(p) for p in supervised), "the run died with the kernel that started it"

    second = ProtocolKernel(tmp_path)
    try:
        for cell in ("%load_ext nbddp", SETUP):
            second.execute(cell)
        out = second.execute(f"%%ddp_train --cpu --attach\n{body}")  # the cell run again: its latest detached run
        assert "epoch 0 rank 1" in out and f"epoch {EPOCHS - 1} rank 1" in out, out
        assert "succeeded in" in out and "model loaded on the CPU" in out, out
        expected = reference(2 * BATCH)["weight"]
        torch.testing.assert_close(_kernel_weight(second), expected, rtol=1e-5, atol=1e-6)
        second.execute("torch.nn.init.zeros_(model.weight)")
        out = second.execute(f"%ddp_attach {run_dir.name}")  # after the end
        assert "epoch 0 rank 1" in out and "model loaded on the CPU" in out, out
        torch.testing.assert_close(_kernel_weight(second), expected, rtol=1e-5, atol=1e-6)
    finally:
        second.close()
    _gone_within(supervised, 10, "the detached run's processes ended with it")


@pytest.mark.slow
@pytest.mark.waits
def test_a_killed_supervisor_takes_its_ranks_and_the_attacher_says_so(tmp_path, cli_run):
    front, run_dir, supervised = _start_long_detached_run(tmp_path, cli_run)
    os.kill(json.loads(RunDir(run_dir).supervisor.read_text())["pid"], signal.SIGKILL)
    _gone_within(supervised, 15, "the ranks ended with their killed supervisor")
    assert front.wait(30) == 1, front.output
    assert "supervisor (pid" in front.output and "is gone and left no result" in front.output, front.output
    # Killed, the supervisor could not remove its notebook kernel's socket folder: the next run does.
    from nbddp.doors.notebook_kernel import SOCKETS_PREFIX
    from nbddp.contracts.process_groups import owned_temp_dir

    os.rmdir(owned_temp_dir(SOCKETS_PREFIX))

