"""Warm ranks: a re-run of ``%%ddp_train`` reuses the kernel's ranks, means the same as a fresh run,
and starts fresh ranks whenever what they were started with no longer holds.

Real kernels (raw execute requests, as JupyterLab sends them), real torchrun, 2 gloo ranks.
"""

from __future__ import annotations

import json
import random
import re
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import alive
from tests.test_magic import ProtocolKernel, run_dirs

pytestmark = pytest.mark.slow

SETUP = """#| ddp
import os, time, torch, nbddp
from torch import nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
X = torch.randn(64, 4)
y = X.sum(1, keepdim=True)"""
TRAIN = """%%ddp_train{flags}
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
    walls = [json.loads((d / "result.json").read_text())["wall_time_s"] for d in run_dirs(tmp_path)]
    assert walls[1] < 1.0 and walls[1] < walls[0] / 3, walls

    fresh = train(kernel, "--fresh")  # the same cells on ranks started for this run alone
    assert not set(pids(fresh).values()) & set(started.values()) and "on a warm rank" not in fresh
    assert weight(kernel) == fresh_weights

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
    (tmp_path / "helper.py").write_text("SCALE = 1\n")
    kernel.execute("#| ddp\nimport helper", "helper")
    started = pids(train(kernel, extra="print('scale', helper.SCALE)\n"))

    (tmp_path / "helper.py").write_text("SCALE = 2  # edited\n")
    edited = train(kernel, extra="print('scale', helper.SCALE)\n")
    assert "starting fresh warm ranks: helper.py changed" in edited and "[rank 1] scale 2" in edited
    started, out = pids(edited), kernel.execute("%env MY_SETTING=1")
    changed_env = train(kernel)
    assert "starting fresh warm ranks: environment variables changed" in changed_env
    assert not set(pids(changed_env).values()) & set(started.values())

    one = train(kernel, "--nproc 1 --cpu")
    assert "starting fresh warm ranks: the devices changed" in one and len(pids(one)) == 1

    failed = train(kernel, "--cpu", extra="if nbddp.rank() == 1:\n    raise ValueError('boom')\n")
    assert "ValueError: boom" in failed
    after_failure = train(kernel, "--cpu")
    assert "starting fresh warm ranks: the last run failed" in after_failure and "[rank 1] trained 1" in after_failure

    timed_out = train(kernel, "--cpu --timeout 4", extra="time.sleep(60)\n")
    assert "timed out" in timed_out
    after_timeout = train(kernel, "--cpu")
    assert "starting fresh warm ranks: the last run timed out" in after_timeout
    assert out is not None


def test_an_interrupted_warm_run_leaves_no_rank_and_the_next_is_fresh_and_correct(kernel, tmp_path):
    started = pids(train(kernel))
    reference = weight(kernel)
    kernel.start_execute(TRAIN.format(flags="", extra="time.sleep(60)\n"), "train")
    time.sleep(3)  # the ranks are sleeping inside the job
    kernel.km.interrupt_kernel()
    out = kernel.finish_execute()
    assert "KeyboardInterrupt\x1b[0m: the run was interrupted after" in out, out
    deadline = time.monotonic() + 15
    while any(alive(p) for p in started.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in started.values())
    again = train(kernel)
    assert "starting fresh warm ranks: the last run was interrupted" in again and weight(kernel) == reference


def test_idle_ranks_exit_and_a_kernel_restart_takes_warm_ranks_with_it(kernel):
    kernel.execute("%ddp_ranks --idle 2")
    started = pids(train(kernel))
    deadline = time.monotonic() + 20
    while any(alive(p) for p in started.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in started.values()), "idle warm ranks outlived --idle"
    assert "no warm ranks" in kernel.execute("%ddp_ranks")
    again = train(kernel)
    assert "starting fresh warm ranks: the warm ranks had exited" in again

    kernel.execute("%ddp_ranks --idle 600")
    running = pids(train(kernel))
    kernel_pid = int(kernel.execute("import os; print(os.getpid())").strip())
    kernel.km.restart_kernel(now=True)  # SIGKILL: the kernel gets no chance to stop them
    deadline = time.monotonic() + 15
    while any(alive(p) for p in running.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in running.values()), "warm ranks outlived their kernel"
    # The killed kernel couldn't remove its pool's folder: the pool's torchrun did, once its ranks were gone.
    from nbddp.launchers.pool_dir import FOLDER_PREFIX

    deadline = time.monotonic() + 10
    while (left := list(Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}{kernel_pid}-*"))) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left


def test_what_warm_ranks_cannot_serve_runs_fresh_and_says_so(kernel):
    """The one rule (warm_pool.why_not_warm), as the magic says it: Catalyst, several nodes, --max-restarts."""
    out = train(kernel, "--max-restarts 1")
    assert "warm ranks can't be restarted by torchrun (--max-restarts): starting fresh ones" in out
    assert "on a warm rank" not in out and "[rank 1] trained 1" in out


def test_a_warm_rank_killed_mid_run_is_named_and_the_next_run_is_fresh(kernel):
    out = train(kernel, extra="if nbddp.rank() == 1:\n    os.kill(os.getpid(), 9)\ntime.sleep(30)\n")
    assert "rank 1 died: killed by SIGKILL" in out, out
    again = train(kernel)
    assert "starting fresh warm ranks: the last run failed" in again and "[rank 1] trained 1" in again
