"""The warm ranks' starter, started when the extension loads (or the nbddp kernel starts): the first ``%%ddp_train``
forks its ranks from it.

Real kernels (raw execute requests), real starters importing torch, 2 gloo ranks. What it must keep: the first
run's weights are a fresh run's; nothing of it reachable by another user (a private folder, no socket); released
after the idle limit and by ``%ddp_ranks stop``; a first run that wants another environment (or thread count) than
the starter imported with gets fresh ranks and says why, and the starter's own check starts it again as that run's
plain starter; a first run and the idle limit can't both claim it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path

import psutil
import pytest

from nbddp.contracts.pool_dir import PoolDir
from nbddp.launchers.warm import agent
from tests.conftest import alive, wait_until
from tests.test_magic import ProtocolKernel, run_dirs
from tests.test_warm import SETUP, pids, train, weight

#: Kernels here start the warm ranks' starter at %load_ext, as users' do (tests/conftest.py).
PREPARES_AHEAD = True
STARTER = re.compile(r"starter \(pid (\d+)\)")


def _starter(kernel) -> int:
    found = STARTER.search(kernel.execute("%ddp_ranks"))
    assert found, kernel.execute("%ddp_ranks")
    return int(found.group(1))


def _folder(pid: int) -> PoolDir:
    """The pool folder a starter was given (its argument after the module)."""
    argv = psutil.Process(pid).cmdline()
    return PoolDir(Path(argv[argv.index("nbddp.launchers.warm.agent") + 1]))


def _wait(condition, what: str, seconds: float = 30.0, detail=None) -> None:
    """:func:`wait_until`, looking every 0.05 s (a starter's folder, its process)."""
    wait_until(condition, seconds, what, every=0.05, detail=detail)


@pytest.fixture
def kernel(tmp_path):
    session = ProtocolKernel(tmp_path)
    yield session
    session.close()


def _forked_from(rank: int, starter: int) -> bool:
    """``rank`` was forked from ``starter``'s process as it is (a fork keeps its parent's command line; a rank started
    as a fresh interpreter, or after the starter started again, has another)."""
    return psutil.Process(rank).ppid() == starter and psutil.Process(rank).cmdline() == psutil.Process(starter).cmdline()


@pytest.fixture
def nbddp_kernel(tmp_path, monkeypatch):
    """A kernel of the nbddp kernelspec (``nbddp kernel install``, here into the test's own folder)."""
    from nbddp.doors.jupyter.kernelspec import KERNEL_NAME, install

    monkeypatch.setenv("JUPYTER_PATH", str(install(prefix=str(tmp_path / "kernels")).parent.parent))
    session = ProtocolKernel(tmp_path, kernel_name=KERNEL_NAME)
    yield session
    session.close()


@pytest.mark.slow
def test_the_nbddp_kernel_starts_the_starter_whose_first_run_forks_the_ranks_with_a_fresh_runs_weights(nbddp_kernel,
                                                                                                       tmp_path):
    """The nbddp kernel starts the starter as it starts, before it answers; ``%load_ext nbddp`` adopts it, and the
    first run's ranks are forked from it although the kernel set variables of its own since (TERM, PAGER, …)."""
    kernel = nbddp_kernel
    kernel_pid = kernel.km.provisioner.process.pid
    ahead = [p.pid for p in psutil.Process(kernel_pid).children() if "nbddp.launchers.warm.agent" in p.cmdline()]
    assert len(ahead) == 1, psutil.Process(kernel_pid).children()  # (the kernel is ready: it started it before)
    starter = ahead[0]
    (tmp_path / "mymod.py").write_text("X = 'from the notebook folder'\n")  # (the folder off the path only at start)
    assert "from the notebook folder" in kernel.execute("import mymod; print(mymod.X)")
    loaded = kernel.execute("%load_ext nbddp")
    assert "[nbddp] preparing warm ranks: their starter, started with this kernel (the nbddp kernel)," in loaded, loaded
    assert _starter(kernel) == starter
    folder = _folder(starter)
    _wait(folder.preloaded.exists, "the starter finished its imports")
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
    assert len(started) == 2 and "[rank 1] trained 1" in first and "could not serve" not in first, first
    assert all(_forked_from(pid, starter) for pid in started.values())  # (the kernel's own variables: not read)
    assert not folder.go.exists()  # (the kernel's environment is on disk no longer than the starter needs it)
    first_weights = weight(kernel)
    shown = kernel.execute("%ddp_ranks")
    assert "2 warm ranks" in shown and re.search(r"\d+(\.\d+)? [kMG]B of memory held", shown), shown
    fresh = train(kernel, "--fresh")
    assert not set(pids(fresh).values()) & set(started.values()) and weight(kernel) == first_weights
    walls = [json.loads((d / "result.json").read_text())["wall_time_s"] for d in run_dirs(tmp_path)]
    assert walls[0] < walls[1] / 3, walls  # the first run, its starter ready, against ranks started for the run

    kernel.execute("%ddp_ranks stop")
    _wait(lambda: not alive(starter) and not folder.path.exists(), "%ddp_ranks stop ended the starter, its folder removed",
          10)


@pytest.mark.slow
@pytest.mark.beside  # asserts no timing: evens out .ci/run's lanes
def test_an_unused_starter_is_released_after_the_idle_limit_and_when_stopped(kernel):
    loaded = kernel.execute("%load_ext nbddp")  # (a plain kernel: the extension starts it)
    assert "[nbddp] preparing warm ranks: their starter imports torch now" in loaded, loaded
    first = _starter(kernel)
    kernel.execute("%ddp_ranks --idle 2")  # a starter waiting for its first run starts again with the new limit
    starter = _starter(kernel)
    folder = _folder(starter)
    assert starter != first
    _wait(lambda: not alive(first), "the starter with the old idle limit ended", 10)
    _wait(lambda: not alive(starter), "the idle starter ended after its idle limit", 60)
    _wait(lambda: not folder.path.exists(), "the idle starter's folder removed", 5)
    assert "no warm ranks: the next %%ddp_train starts them" in kernel.execute("%ddp_ranks")

    assert "preparing warm ranks" in kernel.execute("%ddp_ranks --idle 600 start")
    again = _starter(kernel)
    folder = _folder(again)
    assert "stopped the warm ranks" in kernel.execute("%ddp_ranks stop")
    _wait(lambda: not alive(again), "%ddp_ranks stop ended the starter", 10)
    assert not folder.path.exists()


@pytest.mark.slow
@pytest.mark.beside  # asserts no timing: evens out .ci/run's lanes
def test_a_first_run_the_starter_doesnt_fit_says_why_and_gets_fresh_ranks_with_their_own_threads(kernel):
    """An environment changed since the extension loaded, or one rank on 2 cores (OMP_NUM_THREADS=2, where the
    starter imported torch for the default 2 ranks' 1): the run says why and its ranks are a fresh starter's."""
    kernel.execute("%load_ext nbddp")
    starter = _starter(kernel)
    kernel.execute("%env MY_SETTING=1")
    kernel.execute(SETUP, "setup")
    out = train(kernel, extra="print('setting', os.environ.get('MY_SETTING'))\n")
    assert ("the warm ranks' starter started ahead could not serve this run (environment variables "
            "changed (MY_SETTING)): started a fresh one") in out and "[rank 1] setting 1" in out, out
    _wait(lambda: not alive(starter), "the starter that didn't fit stopped", 5)  # (what it imported no rank may inherit)

    kernel.execute("%ddp_ranks restart")  # a starter with MY_SETTING, which a first run fits
    starter = _starter(kernel)
    out = train(kernel)
    assert "could not serve" not in out and all(_forked_from(pid, starter) for pid in pids(out).values()), out
    kernel.execute("%ddp_ranks restart")
    starter = _starter(kernel)
    out = train(kernel, "--nproc 1", extra="print('threads', torch.get_num_threads())\n")
    threads = os.cpu_count() or 1
    if threads > 1:
        assert f"could not serve this run (1 rank(s) get OMP_NUM_THREADS={threads}, and it imported torch for " \
               f"{max(1, threads // 2)})" in out, out
    assert f"[rank 0] threads {threads}" in out, out  # as a fresh rank would have


@pytest.mark.slow
@pytest.mark.beside  # asserts no timing: evens out .ci/run's lanes
def test_the_starter_itself_checks_the_first_runs_word_and_a_run_that_claimed_it_is_waited_for(tmp_path):
    """The starter's own check (the kernel's comes first): a word that doesn't fit (1 rank: OMP_NUM_THREADS=2 here)
    has it start again as that run's plain starter; one that fits forks the ranks from it, even after its idle
    limit, once the run claimed it before (a first run as the starter was about to leave)."""
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text("import torch\nprint('RANK', torch.get_num_threads(), open('/proc/self/cmdline').read().split(chr(0)))\n")
    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    for nproc, idle, pause in ((1, "30", 0.0), (2, "0.5", 2.0)):
        folder = tmp_path / f"nbddp-warm-{os.getpid()}-{nproc}"
        folder.mkdir(mode=0o700)
        pool, log = PoolDir(folder), tmp_path / f"starter-{nproc}.log"
        with open(log, "wb") as out:
            starter = subprocess.Popen([sys.executable, "-m", "nbddp.launchers.warm.agent", str(folder), agent.PRELOAD,
                                        idle, "2"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait(pool.preloaded.exists, "the starter finished its imports", 60, detail=log.read_text)
            assert pool.claim("run") and not pool.claim("idle")
            time.sleep(pause)  # (past its idle limit: claimed, it waits for the word)
            word = {"argv": ["--nproc", str(nproc), "--report", str(tmp_path / "report.json"), "--", str(script)],
                    "env": env, "cwd": str(tmp_path), "nproc": nproc}
            (folder / "go.json").write_text(json.dumps(word))
            assert starter.wait(60) == 0, log.read_text()
        finally:
            if starter.poll() is None:
                starter.kill()
        lines = [line for line in log.read_text().splitlines() if line.startswith("RANK")]
        assert len(lines) == nproc, log.read_text()
        threads = max(1, (os.cpu_count() or 1) // nproc)
        assert all(line.startswith(f"RANK {threads} ") for line in lines), lines
        assert all((agent.PRELOAD in line) == (nproc == 2) for line in lines), lines  # forked from the preload or not
        assert not folder.exists()  # (its ranks returned: it left, and its folder went)


def test_what_the_imports_read_leaves_out_nbddps_variables_and_the_gpus_chosen():
    base = {"PATH": "/bin", "HOME": "/root"}
    seen = agent.as_imported({**base, "NBDDP_WARM": "1", "CUDA_VISIBLE_DEVICES": "1"}, 2)
    assert seen == {**base, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    assert agent.as_imported({**base, "OMP_NUM_THREADS": "7"}, 2)["OMP_NUM_THREADS"] == "7"  # the user's own
    assert agent.as_imported(base, 2) != agent.as_imported({**base, "MY_SETTING": "1"}, 2)


@pytest.mark.slow
@pytest.mark.beside  # asserts no timing: evens out .ci/run's lanes
def test_a_killed_kernels_starter_goes_with_its_folder(tmp_path):
    """SIGKILL leaves the kernel no chance to stop it: its parent-death signal ends it, and it removes its folder."""
    session = ProtocolKernel(tmp_path)
    try:
        session.execute("%load_ext nbddp")
        starter = _starter(session)
        folder = _folder(starter)
        _wait(folder.preloaded.exists, "the starter finished its imports")  # (waiting for its first run, as mostly)
        session.km.restart_kernel(now=True)  # SIGKILL
        _wait(lambda: not alive(starter), "the starter ended with its SIGKILLed kernel", 10)
        _wait(lambda: not folder.path.exists(), "the killed kernel's starter removed its folder", 5,
              detail=lambda: (sorted(p.name for p in folder.path.iterdir()),
                              (folder.path / "logs" / "launcher.log").read_text()))
    finally:
        session.close()


def test_the_starters_imports_collect_nothing_and_read_nothing_a_kernel_sets_as_it_starts(tmp_path):
    """The starter imports with the garbage collector off (its collections scanned torch's millions of objects, a
    sixth of the import here: benchmarks/first_run.py), freezes what it imported and turns it back on for the ranks.
    What it imports reads none of the variables a kernel sets as it starts (``KERNEL_START_VARIABLES``), which the
    nbddp kernel's starter is started without: every name read through the C library's ``getenv`` (libgomp, OpenBLAS,
    libtorch) or Python's ``os.environ``, recorded."""
    import subprocess
    import sys

    from tests import getenv_recorder

    record = tmp_path / "read.txt"
    code = getenv_recorder.PYTHON_SIDE + (
        "import gc, json\nfrom nbddp.launchers import forked_rank\nfrom nbddp.launchers.warm import agent\n"
        "frozen_at_collections = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and frozen_at_collections.append(gc.get_freeze_count()))\n"
        "forked_rank.preload('1', agent.PRELOADED)\n"
        "print(json.dumps({'frozen at collections': frozen_at_collections, 'collecting': gc.isenabled(), "
        "'frozen': gc.get_freeze_count(), 'imported': 'torch._dynamo' in sys.modules, 'read': sorted(READ)}))\n")
    env = {**os.environ, "LD_PRELOAD": str(getenv_recorder.build(tmp_path)), "GETENV_RECORD": str(record)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["imported"] and found["collecting"] and found["frozen"] > 100_000, found  # torch's objects, frozen
    assert 0 not in found["frozen at collections"], found["frozen at collections"]  # none before the freeze
    read = set(found["read"]) | set(record.read_text().split())
    assert {"OMP_NUM_THREADS", "TORCH_LOGS"} <= read  # (libgomp's getenv, torch's os.environ: the records work)
    assert not {name for name in read if name.startswith(agent.KERNEL_START_VARIABLES)}, sorted(read)


def test_a_starter_the_kernel_started_that_its_first_cells_no_longer_fit_is_started_again_at_load_ext(monkeypatch,
                                                                                                      tmp_path):
    """The nbddp kernel's starter imported with the kernel's environment as it started; a notebook that sets a
    variable (or changes folder) before ``%load_ext nbddp`` no longer fits it, and its first run would start a fresh
    one: ``%load_ext`` starts it again at once and says why. (Real starters; no kernel needed for the rule.)"""
    from nbddp.launchers.warm.keepers import KernelPool

    monkeypatch.chdir(tmp_path)
    pool = KernelPool()
    try:
        assert pool.prepare(say=False) == ""  # (the nbddp kernel, as it starts)
        ahead = pool.preload
        monkeypatch.setenv("MY_SETTING", "1")  # (a first cell: os.environ["MY_SETTING"] = "1")
        said = pool.prepare()
        assert said.startswith("preparing warm ranks: their starter imports torch now") and said.endswith(
            "; the one started with this kernel no longer fit: environment variables changed (MY_SETTING)"), said
        assert pool.preload is not ahead and pool.preload.alive() and not alive(ahead.launch.pid)
        assert pool.prepare() == ""  # (said once)
        again = pool.preload
        assert pool.prepare(say=False) == "" and pool.prepare() == "" and pool.preload is again  # (it fits: kept)
    finally:
        pool.stop()
