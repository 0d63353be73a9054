"""Warm ranks: a re-run of ``%%ddp_train`` reuses the kernel's ranks, means the same as a fresh run,
and starts fresh ranks whenever what they were started with no longer holds.

Real kernels (raw execute requests, as JupyterLab sends them), real torchrun, 2 gloo ranks (``--cpu``, on a
machine with GPUs too; NCCL's warm ranks are tested in tests/test_gpu.py).
"""

from __future__ import annotations

import json
import random
import re
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import alive, wait_until
from tests.test_magic import ProtocolKernel, run_dirs

pytestmark = pytest.mark.slow
#: Kernels here start the warm ranks' starter at %load_ext, as users' do (tests/conftest.py).
PREPARES_AHEAD = True

SETUP = """#| ddp
import os, time, torch, nbddp
from torch import nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
X = torch.randn(64, 4)
y = X.sum(1, keepdim=True)"""
TRAIN = """%%ddp_train --cpu{flags}
ddp = nbddp.prepare(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for epoch in range(3):
    loss = nn.functional.mse_loss(ddp(X), y)
    opt.zero_grad(); loss.backward(); opt.step()
{extra}print('trained', nbddp.rank())"""
STARTED = re.compile(r"\[rank (\d+)\] \[nbddp\] rank \d+/\d+ started \(pid (\d+)\)( on a warm rank)?")


def train(kernel, flags: str = "", extra: str = "") -> str:
    return kernel.execute(TRAIN.format(flags=f" {flags}" if flags else "", extra=extra), "train")


def pids(out: str) -> dict[int, int]:
    return {int(rank): int(pid) for rank, pid, _ in STARTED.findall(out)}


def weight(kernel) -> str:
    return kernel.execute("print(repr(model.weight.detach().tolist()), repr(model.bias.item()))").strip()


@pytest.fixture
def kernel(tmp_path):
    session = ProtocolKernel(tmp_path)
    session.execute("%load_ext nbddp")
    session.execute(SETUP, "setup")
    yield session
    session.close()


def test_a_warm_rerun_gives_a_fresh_runs_weights_in_a_fraction_of_its_time(kernel, tmp_path):
    first = train(kernel)
    fresh_weights, started = weight(kernel), pids(first)
    assert len(started) == 2 and "on a warm rank" not in first  # the first run starts the warm ranks

    again = train(kernel)  # the kernel's model is trained now: the ranks must not continue from it
    assert pids(again) == started and "starting fresh" not in again and "on a warm rank (its run 2)" in again
    assert weight(kernel) == fresh_weights
    fresh = train(kernel, "--fresh")  # the same cells on ranks started for this run alone
    assert not set(pids(fresh).values()) & set(started.values()) and "on a warm rank" not in fresh
    assert weight(kernel) == fresh_weights
    # (Against the fresh run: the first run forked its ranks from a starter that had imported torch as the setup
    # cell ran, a second or so; the fresh one started its own.)
    walls = [json.loads((d / "result.json").read_text())["wall_time_s"] for d in run_dirs(tmp_path)]
    assert walls[1] < 1.0 and walls[1] < walls[2] / 3, walls

    # A job changing process-wide state (torch's settings, its folder, sys.path, a seeded generator)...
    train(kernel, extra="torch.set_default_dtype(torch.float64); torch.set_float32_matmul_precision('medium')\n"
                        "import random, sys; sys.path.insert(0, '/leak'); os.chdir('/'); random.seed(5)\n")
    after = train(kernel, extra="import random, sys\nif nbddp.rank() == 0: print('state', torch.get_default_dtype(), "
                                "torch.get_float32_matmul_precision(), '/leak' in sys.path, os.getcwd() == '/', "
                                "random.random())\n")
    state = re.search(r"\[rank 0\] state (\S+) (\S+) (\S+) (\S+) (\S+)", after)
    assert state.groups()[:4] == ("torch.float32", "highest", "False", "False"), after  # ...doesn't leak,
    assert float(state.group(5)) != random.Random(5).random()  # nor its seeded generator: a fresh rank's is random
    kernel.execute(SETUP.replace("torch.manual_seed(0)", "torch.manual_seed(1)"), "setup")  # an edited ddp cell
    edited = train(kernel)
    assert pids(edited) == started and weight(kernel) != fresh_weights
    assert "[nbddp] " in kernel.execute("%ddp_ranks") and "2 warm ranks" in kernel.execute("%ddp_ranks")


def test_every_change_warm_ranks_were_not_started_with_starts_fresh_ones(kernel, tmp_path):
    """What the ranks were started with (environment, devices) starts fresh ones; an edited local module doesn't:
    the setup cell that imports it runs again (tests/test_warm_state.py)."""
    (tmp_path / "helper.py").write_text("SCALE = 1\n")
    kernel.execute("#| ddp\nimport helper", "helper")
    started = pids(train(kernel, extra="print('scale', helper.SCALE)\n"))

    (tmp_path / "helper.py").write_text("SCALE = 2  # edited\n")  # no reason for fresh ranks: the cell runs again
    edited = train(kernel, extra="print('scale', helper.SCALE)\n")
    assert pids(edited) == started and "ran (helper.py changed)" in edited and "[rank 1] scale 2" in edited, edited
    started, out = pids(edited), kernel.execute("%env MY_SETTING=1")
    changed_env = train(kernel)
    assert "starting fresh warm ranks: environment variables changed" in changed_env
    assert not set(pids(changed_env).values()) & set(started.values())

    one = train(kernel, "--nproc 1")
    assert "starting fresh warm ranks: the devices changed" in one and len(pids(one)) == 1
    assert out is not None


#: Rank 1 raises after training while rank 0 waits for it in an all-reduce.
RAISE_MID_COLLECTIVE = ("import torch.distributed as dist\nif nbddp.rank() == 1:\n    raise ValueError('boom')\n"
                        "dist.all_reduce(torch.ones(1))\n")
#: Rank 1 sleeps while rank 0 waits for it in an all-reduce: an interrupt or a time limit must end both.
STALL_MID_COLLECTIVE = ("import torch.distributed as dist\nif nbddp.rank() == 1:\n    print('stalling', flush=True)\n"
                        "    time.sleep(60)\ndist.all_reduce(torch.ones(1))\n")


def last_wall_time(tmp_path) -> float:
    return json.loads((run_dirs(tmp_path)[-1] / "result.json").read_text())["wall_time_s"]


def warm_time(tmp_path) -> bool:
    """The last run waited for nothing: a warm run's time, on a loaded machine. (Which ranks ran it, the pids say;
    a first run, its ranks forked from a preloaded starter, may take as little as a second itself.)"""
    return last_wall_time(tmp_path) < 3.0


def test_a_failed_timed_out_or_interrupted_run_keeps_its_ranks_and_the_next_run_is_a_fresh_runs(kernel, tmp_path):
    """No cold start after a failure: the ranks leave the failed job (the one in a collective is woken
    when its peer frees its group), rebuild their process group, and the next run gives a fresh run's
    weights on the same processes, in a warm re-run's time."""
    started = pids(train(kernel))
    reference = weight(kernel)

    failed = train(kernel, extra=RAISE_MID_COLLECTIVE)
    assert "ValueError: boom" in failed and "rank 1 raised ValueError" in failed, failed
    after = train(kernel)
    assert "the last run failed: on the same warm ranks, in a new process group" in after, after
    assert pids(after) == started and weight(kernel) == reference and last_wall_time(tmp_path) < 1.0

    timed_out = train(kernel, "--timeout 3", extra=STALL_MID_COLLECTIVE)
    assert "timed out" in timed_out, timed_out
    after = train(kernel)
    assert "the last run timed out: on the same warm ranks, in a new process group" in after, after
    assert pids(after) == started and weight(kernel) == reference

    before = len(run_dirs(tmp_path))
    kernel.start_execute(TRAIN.format(flags="", extra=STALL_MID_COLLECTIVE), "train")
    ranks_in_the_job(tmp_path, [0, 1], before, printed="")  # both in the job
    ranks_in_the_job(tmp_path, [1], before, printed="stalling")  # rank 1 sleeps (rank 0 waits in the all-reduce)
    interrupted_at = time.monotonic()
    kernel.km.interrupt_kernel()
    out = kernel.finish_execute()
    assert "KeyboardInterrupt\x1b[0m: the run was interrupted after" in out, out
    assert time.monotonic() - interrupted_at < 5
    after = train(kernel)
    assert "the last run was interrupted: on the same warm ranks, in a new process group" in after, after
    assert pids(after) == started and weight(kernel) == reference and last_wall_time(tmp_path) < 1.0
    assert all(alive(pid) for pid in started.values())


def ranks_in_the_job(tmp_path, ranks, runs_before: int, printed: str = "", timeout: float = 60) -> None:
    """Wait until each of ``ranks`` has started the newest run's job (its ``ranks/rank-N.json``), and
    printed ``printed``."""
    from nbddp.contracts.rundir import RunDir

    def there(run: RunDir, rank: int) -> bool:
        if not run.rank_info(rank).exists():
            return False
        return not printed or printed in run.rank_log(rank).read_text(errors="replace")

    def in_the_job() -> bool:
        runs = run_dirs(tmp_path)
        return len(runs) > runs_before and all(there(RunDir(runs[-1]), r) for r in ranks)

    wait_until(in_the_job, timeout, f"ranks {ranks} started the job" + (f" and printed {printed!r}" if printed else ""),
               every=0.05)


def interrupt(kernel, after: float | None = None, then=None) -> tuple[str, float]:
    """The stop button, while the cell runs; ``then()`` runs ``after`` seconds later. The cell's output, and
    how long the cell took to end after the interrupt."""
    import threading

    timer = threading.Timer(after, then) if then is not None else None
    interrupted_at = time.monotonic()
    kernel.km.interrupt_kernel()
    if timer is not None:
        timer.start()
    try:
        return kernel.finish_execute(), time.monotonic() - interrupted_at
    finally:
        if timer is not None:
            timer.join()


#: Every rank takes 5 s to leave once interrupted (a clean-up that saves something; a loaded machine).
SLOW_TO_LEAVE = ("try:\n    print('waiting', flush=True)\n    time.sleep(60)\n"
                 "except KeyboardInterrupt:\n    end = time.monotonic() + 5\n"
                 "    while time.monotonic() < end:\n        pass\n    raise\n")


def test_an_interrupt_that_comes_before_a_rank_took_the_job_keeps_the_ranks(kernel, tmp_path):
    """A loaded machine stretches every step: the interrupt may come before a rank took the job (it was sent only
    to the ranks then running, and a rank ignores SIGINT between jobs, so that rank then ran the whole job and the
    pool was lost: issue 32's "could not be kept"). The job is marked stopped: a rank that takes it later ends it
    without running it, the ranks are kept, and the next run is a warm one."""
    import os
    import signal

    started = pids(train(kernel))
    reference = weight(kernel)

    # Rank 1 is paused (SIGSTOP: the scheduler of a loaded machine, stretched) before it takes the job, while
    # rank 0 takes it and waits for rank 1 in DDP's first collective. Rank 1 hears of the interrupt 5 s later.
    os.kill(started[1], signal.SIGSTOP)
    try:
        before = len(run_dirs(tmp_path))
        kernel.start_execute(TRAIN.format(flags="", extra=""), "train")
        ranks_in_the_job(tmp_path, [0], before)
        out, took = interrupt(kernel, 5, lambda: os.kill(started[1], signal.SIGCONT))
    finally:
        if alive(started[1]):
            os.kill(started[1], signal.SIGCONT)
    assert "KeyboardInterrupt\x1b[0m: the run was interrupted after" in out, out
    assert "[rank 1] [nbddp] rank 1/2 started" not in out, out  # it ended the job without running it
    assert took < 15, took
    after = train(kernel)
    assert "the last run was interrupted: on the same warm ranks, in a new process group" in after, after
    assert pids(after) == started and weight(kernel) == reference and warm_time(tmp_path)
    assert all(alive(pid) for pid in started.values())


def test_ranks_that_take_seconds_to_leave_are_waited_for_and_kept(kernel, tmp_path):
    """A rank that heard the interrupt and keeps working on its way out (a clean-up; a loaded machine) is slow,
    not stuck: the interrupt waits for it (it was given 3 s), and the ranks are kept."""
    started = pids(train(kernel))
    reference = weight(kernel)
    before = len(run_dirs(tmp_path))
    kernel.start_execute(TRAIN.format(flags="", extra=SLOW_TO_LEAVE), "train")
    ranks_in_the_job(tmp_path, [0, 1], before, printed="waiting")
    out, took = interrupt(kernel)
    assert "KeyboardInterrupt\x1b[0m: the run was interrupted after" in out, out
    assert 4.5 < took < 15, took  # it waited for the ranks that kept working on their way out
    after = train(kernel)
    assert "the last run was interrupted: on the same warm ranks, in a new process group" in after, after
    assert pids(after) == started and weight(kernel) == reference and warm_time(tmp_path)
    assert all(alive(pid) for pid in started.values())


#: Rank 1 sleeps where no interrupt reaches it (SIGINT blocked: as in C code that never returns) while rank 0
#: waits for it in an all-reduce. (Each rank says ``to the all-reduce`` first, on the same line: the lines stay
#: those the test names; rank 0's next step is the all-reduce, rank 1's is to block SIGINT and say ``waiting``.)
STUCK = ("import signal, torch.distributed as dist; print('to the all-reduce', flush=True)\nif nbddp.rank() == 1:\n"
         "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n    print('waiting', flush=True)\n"
         "    time.sleep(60)\n"
         "dist.all_reduce(torch.ones(1))\n")
#: The same rank spinning on the CPU in one C call that never returns to Python, as one in CUDA's synchronize
#: does (on a GPU: tests/test_gpu.py): its CPU time grows, its Python stack doesn't move.
SPINNING = STUCK.replace("    time.sleep(60)\n", "    __import__('hashlib').pbkdf2_hmac('sha256', b'p', b's', (1 << 31) - 1)\n")


@pytest.mark.parametrize("extra, limit", [(STUCK, 15), pytest.param(SPINNING, 8, marks=pytest.mark.beside)],
                         ids=["sleeping", "spinning"])
def test_a_rank_that_cannot_leave_is_replaced_and_named_with_where_it_was(kernel, tmp_path, extra, limit):
    started = pids(train(kernel))
    reference = weight(kernel)
    before = len(run_dirs(tmp_path))
    kernel.start_execute(TRAIN.format(flags="", extra=extra), "train")
    ranks_in_the_job(tmp_path, [0], before, printed="to the all-reduce")  # rank 0 in the all-reduce,
    ranks_in_the_job(tmp_path, [1], before, printed="waiting")  # rank 1 in its sleep (or its loop), SIGINT blocked
    kernel.wait_for_display()  # (the kernel follows the job: under load it may lag the ranks the pool handed it to)
    out, took = interrupt(kernel)
    assert "KeyboardInterrupt\x1b[0m: the run was interrupted after" in out, out
    assert took < limit, took  # spinning: judged by its stack, not its CPU time (that took LEAVE_SECONDS, 30 s)
    after = train(kernel)
    said = next((line for line in after.splitlines() if "could not be kept" in line), after)
    # The magic's line and TRAIN's 5, then STUCK's: rank 1 sleeps on the cell's line 11, rank 0 waits on line 12.
    assert "the last run was interrupted and its warm ranks could not be kept (rank 0 couldn't leave the job: " \
           "in all_reduce at distributed_c10d.py:" in said, said
    assert ", from the %%ddp_train cell, line 12; rank 1 couldn't leave the job: at the %%ddp_train cell, line 11): " \
           "on fresh ones, started as it ended (" in said, said
    log = (run_dirs(tmp_path)[-2] / "logs" / "rank-1.log").read_text()  # the whole stack, in the run's log
    assert "[nbddp] rank 1 couldn't leave the job after the interrupt; where it was (most recent call last):" in log
    assert "[the %%ddp_train cell, line 11]" in log, log
    assert "[rank 1] [nbddp] rank 1 couldn't leave the job after the interrupt" in out, out  # and in the view
    assert not set(pids(after).values()) & set(started.values()) and weight(kernel) == reference
    wait_until(lambda: not any(alive(p) for p in started.values()), 15, "the stuck ranks ended with their pool")


def test_idle_ranks_exit_and_a_kernel_restart_takes_warm_ranks_with_it(kernel):
    kernel.execute("%ddp_ranks --idle 2")
    started = pids(train(kernel))
    wait_until(lambda: not any(alive(p) for p in started.values()), 20, "idle warm ranks exited after --idle 2",
               every=0.2)
    assert "no warm ranks" in kernel.execute("%ddp_ranks")
    again = train(kernel)
    assert "starting fresh warm ranks: the warm ranks had exited" in again

    kernel.execute("%ddp_ranks --idle 600")
    running = pids(train(kernel))
    kernel_pid = int(kernel.execute("import os; print(os.getpid())").strip())
    kernel.km.restart_kernel(now=True)  # SIGKILL: the kernel gets no chance to stop them
    wait_until(lambda: not any(alive(p) for p in running.values()), 15, "the warm ranks ended with their kernel",
               every=0.2)
    # The killed kernel couldn't remove its pool's folder: the pool's torchrun did, once its ranks were gone.
    from nbddp.contracts.pool_dir import FOLDER_PREFIX

    wait_until(lambda: not list(Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}{kernel_pid}-*")), 10,
               "the killed kernel's pool folder removed", every=0.2)


def test_what_warm_ranks_cannot_serve_runs_fresh_and_says_so(kernel):
    """The one rule (warm.rules.why_not_warm), as the magic says it: Catalyst, several nodes, --max-restarts."""
    out = train(kernel, "--max-restarts 1")
    assert "warm ranks can't be restarted by torchrun (--max-restarts): starting fresh ones" in out
    assert "on a warm rank" not in out and "[rank 1] trained 1" in out


def test_a_warm_rank_killed_mid_run_is_named_and_fresh_ranks_start_as_the_run_ends(kernel):
    """A killed rank costs the pool (its starter stops the others): fresh ranks start as the run ends, not when
    the cell runs again, and the next run on them gives a fresh run's weights."""
    first = pids(train(kernel))
    reference = weight(kernel)
    out = train(kernel, extra="if nbddp.rank() == 1:\n    os.kill(os.getpid(), 9)\ntime.sleep(30)\n")
    assert "rank 1 died: killed by SIGKILL" in out, out
    described = kernel.execute("%ddp_ranks")
    assert "2 warm ranks" in described and "0 run(s)" in described, described  # replacements, already starting
    again = train(kernel)
    assert "the last run failed and its warm ranks could not be kept (its ranks had exited): on fresh ones, " \
           "started as it ended" in again, again
    assert not set(pids(again).values()) & set(first.values()) and weight(kernel) == reference


def test_the_pool_folder_goes_although_its_killed_owner_keeps_signalling(tmp_path):
    """A SIGKILLed kernel may send its warm agent several parent-death SIGTERMs (Linux re-parents the
    agent to each of the kernel's dying threads in turn). One that landed while the agent removed the
    pool folder once left it behind (the full tier's flake): a storm of them must not."""
    import os
    import signal
    import subprocess
    import sys

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid nobody holds: the pool's "owner" is gone
    pool = tmp_path / f"nbddp-warm-{dead.pid}-storm"
    for index in range(40):  # enough files that removing them takes a while
        folder = pool / "ended" / str(index)
        folder.mkdir(parents=True)
        for name in range(100):
            (folder / f"{name}.json").write_text("{}")
    rank = "import time, pathlib, os; pathlib.Path(os.environ['READY'] + os.environ['RANK']).write_text(str(os.getpid()))\n" \
           "time.sleep(600)"
    (tmp_path / "rank.py").write_text(rank)
    env = {**os.environ, "READY": str(tmp_path / "ready-"), "TMPDIR": str(tmp_path)}  # torchelastic's folder too
    agent = subprocess.Popen(
        [sys.executable, "-m", "nbddp.launchers.warm.agent", str(pool), "--nproc", "2", "--report",
         str(tmp_path / "launch.json"), "--", str(tmp_path / "rank.py")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: all((tmp_path / f"ready-{r}").exists() for r in (0, 1)), 60, "the ranks started",
                   every=0.05)

        def gone_under_a_storm() -> bool:
            if agent.poll() is not None:
                return True
            agent.send_signal(signal.SIGTERM)
            return False

        wait_until(gone_under_a_storm, 60, "the agent left under a storm of SIGTERMs", every=0.002)
        assert agent.wait(30) is not None
        assert not pool.exists(), sorted(str(p.relative_to(pool)) for p in pool.rglob("*"))[:5]
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        for ready in tmp_path.glob("ready-*"):  # plain scripts: no parent-death signal of their own
            try:
                os.kill(int(ready.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
