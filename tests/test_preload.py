"""The warm ranks' starter, started when the extension loads: the first ``%%ddp_train`` forks its ranks from it.

Real kernels (raw execute requests), real starters importing torch, 2 gloo ranks. What it must keep: the first
run's weights are a fresh run's; nothing of it reachable by another user (a private folder, no socket); released
after the idle limit and by ``%ddp_ranks stop``; a first run that wants another environment than the starter
imported with gets a plain starter (the same process, started again), with its own thread count.
"""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path

import psutil
import pytest

from nbddp.contracts.pool_dir import PoolDir
from nbddp.launchers.warm import agent
from tests.conftest import alive
from tests.test_magic import ProtocolKernel
from tests.test_warm import SETUP, pids, train, weight

STARTER = re.compile(r"starter \(pid (\d+)\)")


def _starter(kernel) -> int:
    found = STARTER.search(kernel.execute("%ddp_ranks"))
    assert found, kernel.execute("%ddp_ranks")
    return int(found.group(1))


def _folder(pid: int) -> PoolDir:
    """The pool folder a starter was given (its argument after the module)."""
    argv = psutil.Process(pid).cmdline()
    return PoolDir(Path(argv[argv.index("nbddp.launchers.warm.agent") + 1]))


def _wait(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.fixture
def kernel(tmp_path):
    session = ProtocolKernel(tmp_path)
    yield session
    session.close()


@pytest.mark.slow
def test_the_extension_prepares_the_ranks_whose_first_run_forks_them_with_a_fresh_runs_weights(kernel, tmp_path):
    loaded = kernel.execute("%load_ext nbddp")
    assert "[nbddp] preparing warm ranks: their starter imports torch now" in loaded, loaded
    starter = _starter(kernel)
    folder = _folder(starter)
    assert _wait(folder.preloaded.exists), "the starter never finished its imports"
    shown = kernel.execute("%ddp_ranks")
    assert "has imported torch and what DDP needs" in shown and re.search(r"holds \d+(\.\d+)? [kMG]B of memory", shown)
    # Nothing of it for another user: its folder is private, and it listens on nothing.
    assert stat.S_IMODE(folder.path.stat().st_mode) == 0o700
    assert psutil.Process(starter).net_connections(kind="inet") == []
    assert "[nbddp]" not in kernel.execute("%load_ext nbddp")  # loaded again: the same starter, nothing said
    assert _starter(kernel) == starter

    kernel.execute(SETUP, "setup")
    first = train(kernel)
    started = pids(first)
    assert len(started) == 2 and "[rank 1] trained 1" in first, first
    assert all(psutil.Process(pid).ppid() == starter for pid in started.values())  # forked from the preloaded one
    first_weights = weight(kernel)
    shown = kernel.execute("%ddp_ranks")
    assert "2 warm ranks" in shown and re.search(r"\d+(\.\d+)? [kMG]B of memory held", shown), shown
    fresh = train(kernel, "--fresh")
    assert not set(pids(fresh).values()) & set(started.values()) and weight(kernel) == first_weights

    kernel.execute("%ddp_ranks stop")
    assert _wait(lambda: not alive(starter) and not folder.path.exists(), 10)


@pytest.mark.slow
def test_an_unused_starter_is_released_after_the_idle_limit_and_when_stopped(kernel):
    kernel.execute("%load_ext nbddp")
    first = _starter(kernel)
    kernel.execute("%ddp_ranks --idle 2")  # a starter waiting for its first run starts again with the new limit
    starter = _starter(kernel)
    folder = _folder(starter)
    assert starter != first and _wait(lambda: not alive(first), 10)
    assert _wait(lambda: not alive(starter), 60), "the idle starter stayed"
    assert _wait(lambda: not folder.path.exists(), 5), "the idle starter's folder stayed"
    assert "no warm ranks: the next %%ddp_train starts them" in kernel.execute("%ddp_ranks")

    assert "preparing warm ranks" in kernel.execute("%ddp_ranks --idle 600 start")
    again = _starter(kernel)
    folder = _folder(again)
    assert "stopped the warm ranks" in kernel.execute("%ddp_ranks stop")
    assert _wait(lambda: not alive(again), 10) and not folder.path.exists()


@pytest.mark.slow
def test_a_first_run_that_wants_another_environment_gets_a_plain_starter_with_its_own_threads(kernel):
    """One rank on 2 cores gets OMP_NUM_THREADS=2, where the starter imported torch for the default 2 ranks' 1:
    the starter starts again as that run's (the same process), and the rank has the threads a fresh one would."""
    kernel.execute("%load_ext nbddp")
    starter = _starter(kernel)
    kernel.execute("%env MY_SETTING=1")
    kernel.execute(SETUP, "setup")
    out = train(kernel, "--nproc 1", extra="print('threads', torch.get_num_threads(), os.environ.get('MY_SETTING'))\n")
    assert "[rank 0] trained 0" in out, out
    expected = max(1, (os.cpu_count() or 1))
    assert f"threads {expected} 1" in out, out
    (rank,) = pids(out).values()
    assert psutil.Process(rank).ppid() == starter  # the same process, started again as this run's starter


def test_what_the_imports_read_leaves_out_nbddps_variables_and_the_gpus_chosen():
    base = {"PATH": "/bin", "HOME": "/root"}
    seen = agent._as_imported({**base, "NBDDP_WARM": "1", "CUDA_VISIBLE_DEVICES": "1"}, 2)
    assert seen == {**base, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    assert agent._as_imported({**base, "OMP_NUM_THREADS": "7"}, 2)["OMP_NUM_THREADS"] == "7"  # the user's own
    assert agent._as_imported(base, 2) != agent._as_imported({**base, "MY_SETTING": "1"}, 2)


@pytest.mark.slow
def test_a_killed_kernels_starter_goes_with_its_folder(tmp_path):
    """SIGKILL leaves the kernel no chance to stop it: its parent-death signal ends it, and it removes its folder."""
    session = ProtocolKernel(tmp_path)
    try:
        session.execute("%load_ext nbddp")
        starter = _starter(session)
        folder = _folder(starter)
        assert _wait(folder.preloaded.exists)  # (waiting for its first run, as it mostly is)
        session.km.restart_kernel(now=True)  # SIGKILL
        assert _wait(lambda: not alive(starter), 10), "the starter outlived its kernel"
        assert _wait(lambda: not folder.path.exists(), 5), "its folder stayed"
    finally:
        session.close()
