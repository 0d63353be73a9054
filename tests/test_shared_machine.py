"""A run on a shared machine (DESIGN.md, "Shared machines"; docs/reliability.md, "Security"): nothing of a
run on one machine can be reached from another host, no other local user can read or write where its ranks
meet, and poking at what it does listen on (gloo's pairs, on loopback) neither reads a key nor breaks the run.

Real runs: ``nbddp run`` (2 gloo ranks) and a kernel's idle warm pool; "another user" is ``uid 65534``
(``setpriv``), with the system's own Python (it can't read root's site-packages).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from nbddp.contracts.pool_dir import PoolDir
from tests.conftest import code, wait_until, write_notebook

pytestmark = pytest.mark.slow
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
TRAINING = ("#| ddp-train\nimport time, torch.distributed as dist\nfor step in range({steps}):\n"
            "    t = torch.ones(1); dist.all_reduce(t)\n    print('step', step, t.item(), flush=True)\n    time.sleep(0.2)")


def listeners(pids: set[int]) -> list[tuple[str, int, int]]:
    """``(address, port, pid)`` of every listening TCP socket of ``pids``."""
    return [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def stores_answering(ports: list[int]) -> dict[int, str]:
    """What a torch ``TCPStore`` client reads on each of ``ports`` (only those where a store answered within
    5 s). One process of their own, a thread each: on a gloo pair's listener the client can wait for a reply that
    never comes, whatever its timeout, so the process leaves without waiting for such threads."""
    probe = ("import datetime, os, sys, threading, time, torch.distributed as dist\n"
             "def ask(port):\n"
             "    try:\n"
             "        store = dist.TCPStore('127.0.0.1', port, is_master=False, wait_for_workers=False,\n"
             "                              timeout=datetime.timedelta(seconds=2))\n"
             "        print(port, store.num_keys(), 'keys', flush=True)\n"
             "    except Exception:\n"
             "        pass\n"
             "for port in map(int, sys.argv[1:]):\n"
             "    threading.Thread(target=ask, args=(port,), daemon=True).start()\n"
             "time.sleep(5)\n"
             "os._exit(0)")
    answer = subprocess.run([sys.executable, "-c", probe, *map(str, ports)], capture_output=True, text=True,
                            timeout=60)
    return {int(line.split()[0]): line for line in answer.stdout.splitlines() if line.strip()}


def as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30)


def assert_private(folder: Path) -> None:
    """``folder`` (where ranks meet) is the user's alone: another uid can neither list it nor read or add a file."""
    assert folder.is_dir() and folder.stat().st_mode & 0o077 == 0, oct(folder.stat().st_mode)
    for argv in (["ls", str(folder)], ["cat", str(folder / "rendezvous")], ["touch", str(folder / "planted")]):
        denied = as_nobody(*argv)
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, (argv, denied)


def assert_unreachable(pids: set[int]) -> list[tuple[str, int, int]]:
    found = listeners(pids)
    assert all(address in LOOPBACK for address, _, _ in found), found
    answered = stores_answering([port for _, port, _ in found])
    assert not answered, answered  # gloo's pairs: no key to read, nothing to unpickle
    return found


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_a_run_on_one_machine_listens_on_loopback_only_and_no_store_answers(tmp_path, cli_run):
    """The stores torchrun's ``--standalone`` opened on every interface (its rendezvous state unpickled on each
    heartbeat) are files in the run's 0700 folder; the ranks' pairs listen on loopback, and poking them as a
    store reads nothing and doesn't disturb the training.

    The notebook is the worst a shared project folder can hold: the folder is world-writable with a ``typing.py``
    and an ``nbddp.py`` planted in it (nbddp's processes import neither: tests/test_safe_path.py); its ``runs/``
    others can read (made private, saying so); its name ends a comment line and holds code (it stays data:
    tests/test_names_are_data.py); a rank prints escape sequences that would set the window's title and write the
    clipboard (shown escaped: tests/test_terminal.py)."""
    from tests.test_names_are_data import PAYLOAD
    from tests.test_safe_path import plant, planted_imports
    from tests.test_terminal import HOSTILE_LINE, SHOWN

    mark = plant(tmp_path, "typing.py", "nbddp.py")  # (so the notebook imports neither itself)
    (tmp_path / "runs").mkdir(mode=0o755)
    (tmp_path / "runs").chmod(0o755)
    name = f"f\n{PAYLOAD}.ipynb"
    line = HOSTILE_LINE.split("\r")[0]  # (a \r redraws a rank's line: its last part shows)
    write_notebook(tmp_path / name, [code("import torch\nLINE = " + repr(line), "ddp"),
                                     code(TRAINING.format(steps=40) + "\nprint(LINE, flush=True)")])
    run = cli_run(["run", name, "--cpu"], tmp_path)
    run.wait_for("[rank 1] step 2")
    ours = assert_unreachable(run.seen)
    assert_private(next((tmp_path / "runs").glob("f*")) / "store")
    assert run.wait(timeout=120) == 0, run.output
    assert "[rank 0] step 39 2.0" in run.output and "[rank 1] step 39 2.0" in run.output
    assert not run.leftovers(grace=1)
    assert not {port for _, port, _ in ours} & {port for _, port, _ in listeners(set(psutil.pids()))}
    assert planted_imports(mark) == "" and not list(tmp_path.rglob("PWNED"))
    assert f"the runs folder {tmp_path / 'runs'} could be read by others (mode drwxr-xr-x): made it private" in run.output
    assert (tmp_path / "runs").stat().st_mode & 0o077 == 0
    assert f"[rank 1] {SHOWN.split(chr(13))[0]}" in run.output and "\x1b]" not in run.output, run.output


@pytest.mark.beside  # (waits for a pool to idle, asserts no timing: .ci/run's beside lane)
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_an_idle_warm_pool_listens_on_loopback_only_and_no_store_answers(tmp_path):
    from tests.test_magic import ProtocolKernel
    from tests.test_safe_path import plant, planted_imports

    mark = plant(tmp_path, "typing.py")  # (the starter, its agent and the ranks import nothing from the folder)
    kernel = ProtocolKernel(tmp_path)
    try:
        kernel.execute("%load_ext nbddp")
        kernel.execute("#| ddp\nimport torch, nbddp", "setup")
        out = kernel.execute("%%ddp_train --cpu\n" + TRAINING.format(steps=2).split("\n", 1)[1], "train")
        assert "[rank 1] step 1 2.0" in out, out
        agent = [p for p in psutil.Process(kernel.km.provisioner.process.pid).children(recursive=True)
                 if _runs(p.pid, "nbddp.launchers.warm.agent") and not _runs(p.ppid(), "nbddp.launchers.warm.agent")]
        assert len(agent) == 1, agent
        pool = PoolDir(Path(agent[0].cmdline()[agent[0].cmdline().index("nbddp.launchers.warm.agent") + 1]))
        wait_until(lambda: _idle(pool, 2), 30, "both ranks idle: the setup put back after the job, waiting for the next")
        pids = {agent[0].pid, *(c.pid for c in agent[0].children(recursive=True))}
        assert len(pids) == 3
        assert_unreachable(pids)
        assert_private(pool.path / "store")
        again = kernel.execute("%%ddp_train --cpu\n" + TRAINING.format(steps=2).split("\n", 1)[1], "train")
        assert "on a warm rank (its run 2)" in again and "[rank 1] step 1 2.0" in again, again
    finally:
        kernel.close()
    assert planted_imports(mark) == ""


@pytest.mark.parametrize("launcher, flags", [("nbddp.launchers.direct_main", []),
                                             ("nbddp.launchers.torchrun_main", ["--max-restarts", "1"])],
                         ids=["direct", "torchrun"])
def test_ranks_whose_launcher_dies_while_they_start_exit_on_their_own(tmp_path, cli_run, launcher, flags):
    """A rank asks to die with its launcher before it imports torch, and then checks that its launcher is still
    its parent: one killed in between (a kernel taken by the OOM killer while it forks) would never signal it.
    The window is made deterministic by a fault hook: a ``sitecustomize`` that holds each rank for 3 s before
    it arms (:data:`HOLD_EACH_RANK`), while the test SIGKILLs the launcher (nbddp's own starter, which forks its
    ranks, or torchrun's agent with --max-restarts, which starts fresh interpreters)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_EACH_RANK)
    write_notebook(tmp_path / "f.ipynb", [code("import torch, nbddp", "ddp"), code(TRAINING.format(steps=300))])
    run = cli_run(["run", "f.ipynb", "--cpu", *flags], tmp_path,
                  env={"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))})

    def ranks_started() -> tuple[list[psutil.Process], list[psutil.Process]] | None:
        seen = list(run.seen)  # (one C call: the watcher thread adds to the set meanwhile)
        agents = [psutil.Process(pid) for pid in seen if _runs(pid, launcher) and not _runs(_parent(pid), launcher)]
        ranks = [child for agent in agents for child in agent.children() if _runs(child.pid, "train.py")]
        return (agents, ranks) if len(ranks) >= 2 else None

    agents, ranks = wait_until(ranks_started, 60, "the launcher started both ranks", every=0.01,
                               detail=lambda: run.output)
    assert len(ranks) == 2, run.output
    agents[0].kill()  # the launcher dies before its ranks armed their death signal
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    for rank in alive:
        rank.kill()
    assert not alive, "ranks outlived their launcher"
    assert run.wait(timeout=60) != 0
    assert not run.leftovers()


#: The fault hook: each rank held for 3 s before it arms its death signal. torchrun's ranks are fresh interpreters
#: (held before their first line: a process whose ``NBDDP_PARENT`` is its parent); nbddp's starter forks its ranks
#: from itself (:mod:`nbddp.launchers.forked_rank`), so there the fork is held, in the child.
HOLD_EACH_RANK = """
import os, time
if os.environ.get('NBDDP_PARENT') == str(os.getppid()):
    time.sleep(3)
with open('/proc/self/cmdline', 'rb') as cmdline:
    if b'nbddp.launchers.direct_main' in cmdline.read():
        _fork = os.fork
        def _held_fork():
            pid = _fork()
            if pid == 0:
                time.sleep(3)
            return pid
        os.fork = _held_fork
"""


def _idle(pool, nproc: int) -> bool:
    """Every rank of ``pool`` has ended the last job handed out and put its setup back (what it keeps says that job:
    written last, as the rank goes back to waiting for its next)."""
    last = pool.jobs_handed_out() - 1
    for rank in range(nproc):
        try:
            if json.loads(pool.kept(rank).read_text()).get("job", -1) < last:
                return False
        except (OSError, ValueError):
            return False
    return True


def _parent(pid: int) -> int:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return 0


def _runs(pid: int, what: str) -> bool:
    try:
        return any(what in part for part in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
