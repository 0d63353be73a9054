"""How the ranks of a stopped warm job are judged as they leave it (nbddp.launchers.warm.departure): by
progress, not by a clock. Real processes stand for the ranks (a busy one, a blocked one, a paused one), over a
real pool folder; the stall limit is shortened so that each case takes a moment.

(The same rule with real kernels and torch ranks: tests/test_warm.py.)
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nbddp.contracts.atomic import write_json
from nbddp.contracts.devices import resolve
from nbddp.launchers.warm import departure as warm_departure
from nbddp.launchers.local_process import AdoptedGroup
from nbddp.contracts.pool_dir import PoolDir
from nbddp.launchers.warm.departure import Departure, main_thread_frames, where
from nbddp.launchers.warm import pool as warm_pool
from nbddp.launchers.warm.pool import WarmPool
from tests.conftest import settled, wait_until

BUSY = [sys.executable, "-c", "while True: pass"]
BLOCKED = ["sleep", "60"]


@pytest.fixture
def ranks():
    """Start stand-ins for ranks; every one is killed at the end."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str]) -> subprocess.Popen:
        # Deaf to SIGUSR1 (a stuck rank is asked for its stacks with it; these write none).
        started.append(subprocess.Popen(argv, preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN)))
        return started[-1]

    yield start
    for process in started:
        process.kill()
        process.wait()


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(warm_departure, "SETTLE_SECONDS", 0.6)
    monkeypatch.setattr(warm_departure, "STACK_SECONDS", 0.3)


def pool_of(tmp_path: Path, *processes: subprocess.Popen) -> WarmPool:
    """A pool whose ranks are ``processes`` (its torchrun: this process), job 0 handed out and stopped."""
    directory = PoolDir(tmp_path / "pool")
    directory.ready_dir.mkdir(parents=True)
    write_json(directory.description, {})
    for rank, process in enumerate(processes):
        write_json(directory.ready(rank), process.pid)
    directory.jobs.mkdir()
    write_json(directory.job(0), {"script": str(tmp_path / "train.py"), "env": {}})
    directory.mark(directory.stopped(0))
    pool = WarmPool.__new__(WarmPool)
    pool.devices, pool.dir, pool.stopped, pool.lost = resolve(cpu=True, nproc=len(processes)), directory, False, ""
    pool.launch = AdoptedGroup(os.getpid(), os.getpgid(0))
    return pool


def take(pool: WarmPool, *ranks: int) -> None:
    for rank in ranks:
        pool.dir.mark(pool.dir.taken(0, rank))


def end(pool: WarmPool, rank: int, status: str = "interrupted", released: bool = True) -> None:
    """Rank ``rank`` ended job 0 with ``status`` (and, when that isn't ``ok``, freed its group if ``released``)."""
    pool.dir.job_exits_dir.mkdir(exist_ok=True)
    write_json(pool.dir.job_exit(0, rank), {"status": status})
    if released and status != "ok":
        pool.dir.mark(pool.dir.released(0, rank))


def answer_within(departure: Departure, seconds: float) -> str | None:
    """The verdict ``departure`` comes to within ``seconds`` (asked every 0.02 s), or ``None``: none yet, the ranks
    still waited for (each caller asserts which it expects)."""
    answers: list[str | None] = []

    def answered() -> bool:
        answers.append(departure.check())
        return answers[-1] is not None

    return answers[-1] if settled(answered, seconds, every=0.02) else None  # (none: what a caller asserting it expects)


def test_ranks_that_make_progress_are_waited_for_and_a_stall_names_the_ranks(tmp_path, ranks):
    busy, blocked = ranks(BUSY), ranks(BLOCKED)
    pool = pool_of(tmp_path, blocked, busy)
    take(pool, 0, 1)
    departure = Departure(pool, 0)
    assert answer_within(departure, 1.2) is None  # rank 1 works (it may be what rank 0 waits for): no verdict
    end(pool, 1)
    # Rank 0 now waits for nothing that moves: stuck once no progress was seen for SETTLE_SECONDS.
    assert answer_within(departure, 3.0) == "rank 0 couldn't leave the job"
    end(pool, 0)
    assert Departure(pool, 0).check() == ""  # everyone out


def test_a_rank_that_heard_the_interrupt_or_is_paused_is_responsive_not_stuck(tmp_path, ranks):
    blocked, paused = ranks(BLOCKED), ranks(BLOCKED)
    pool = pool_of(tmp_path, blocked, paused)
    take(pool, 0)  # rank 1 hasn't taken the job, and is paused (SIGSTOP: a loaded machine, stretched)
    os.kill(paused.pid, signal.SIGSTOP)
    departure = Departure(pool, 0)
    assert answer_within(departure, 1.2) is None
    os.kill(paused.pid, signal.SIGCONT)  # continued: it gets its own SETTLE_SECONDS to show progress
    assert answer_within(departure, 0.3) is None
    assert answer_within(departure, 3.0) == "rank 0 couldn't leave the job; rank 1 hadn't taken the job"

    heard = Departure(pool, 0)
    pool.dir.heard(0, 0).parent.mkdir(exist_ok=True)
    write_json(pool.dir.heard(0, 0), {"frames": [[str(tmp_path / "train.py"), 7, "<module>"]]})
    assert answer_within(heard, 1.2) is None  # it runs Python, on its way out: waited for (up to LEAVE_SECONDS)


#: A rank that writes its stacks on SIGUSR1 (as warm ranks do) and then runs ``sys.argv[2]``.
DUMPING = ("import faulthandler, signal, sys, threading\n"
           "stacks = open(sys.argv[1], 'w')\n"
           "stacks.write(f'main thread 0x{threading.main_thread().ident:016x}\\n'); stacks.flush()\n"
           "faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)\n"
           "exec(sys.argv[2])\n")
#: On the CPU in one native call that never returns to Python, as a rank in CUDA's synchronize is.
SPIN_IN_C = "import hashlib; hashlib.pbkdf2_hmac('sha256', b'p', b's', (1 << 31) - 1)"
#: On the CPU in Python whose stack moves (a library that took SIGINT over, still unwinding): calls of random depth.
SPIN_IN_PYTHON = ("import random, time\n"
                  "def deeper(n):\n    return deeper(n - 1) if n else sum(range(100_000))\n"
                  "while True:\n    deeper(random.randrange(10))\n")


def test_a_rank_spinning_in_one_native_call_is_stuck_though_it_spends_cpu_time(tmp_path, ranks, monkeypatch):
    """CPU time alone is no progress from a rank that took the job and hasn't heard the interrupt: it counts only
    where the rank's stack moved between two dumps (the GPU case: tests/test_gpu.py)."""
    monkeypatch.setattr(warm_departure, "SAMPLE_SECONDS", 0.1)  # (SETTLE_SECONDS, 0.6 here, is 6 samples still)

    def dumping_rank(folder: Path, code: str) -> WarmPool:
        stacks = PoolDir(folder / "pool").stack(0)
        stacks.parent.mkdir(parents=True)
        rank = ranks([sys.executable, "-c", DUMPING, str(stacks), code])
        wait_until(lambda: stacks.exists() and stacks.stat().st_size, 60,  # (its handler is registered by then)
                   "the rank wrote its main thread's id", every=0.02)
        pool = pool_of(folder, rank)
        take(pool, 0)
        return pool

    pool, started = dumping_rank(tmp_path / "native", SPIN_IN_C), time.monotonic()
    assert answer_within(Departure(pool, 0), 3.0) == "rank 0 couldn't leave the job: in <module> at <string>:1"
    assert time.monotonic() - started < 2.0  # SETTLE_SECONDS (0.6 here) from the interrupt, and the dumps
    pool = dumping_rank(tmp_path / "python", SPIN_IN_PYTHON)
    assert answer_within(Departure(pool, 0), 2.0) is None  # its stack moves: waited for


def test_ranks_that_have_not_taken_a_stopped_job_are_not_waited_for(tmp_path, ranks):
    pool = pool_of(tmp_path, ranks(BLOCKED), ranks(BLOCKED))
    end(pool, 0)
    assert Departure(pool, 0).check() == ""  # rank 1 ends the job the moment it takes it (the stopped mark)
    assert not pool.busy() and pool.why_not_kept() == ""
    pool.dir.stopped(0).unlink()  # a job nobody stopped: rank 1 would run it
    assert pool.busy() and pool.why_not_kept() == "its ranks are still in the last job"


def test_a_rank_that_ended_badly_is_still_leaving_until_it_freed_its_group(tmp_path, ranks):
    pool = pool_of(tmp_path, ranks(BLOCKED), ranks(BLOCKED))
    end(pool, 0, "failed", released=False)
    end(pool, 1, "ok")
    assert Departure(pool, 0).states() == {0: "releasing", 1: "out"}
    assert answer_within(Departure(pool, 0), 3.0) == "rank 0 ended the job but couldn't free its process group"
    pool.dir.mark(pool.dir.released(0, 0))
    assert Departure(pool, 0).check() == ""


def _blocked_in_event_wait(frame) -> bool:
    """Whether this frame is threading's Condition.wait at the lock it blocks on, called by Event.wait."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return (frame.f_code is threading.Condition.wait.__code__ and frame.f_back is not None
            and frame.f_back.f_code is threading.Event.wait.__code__ and "waiter.acquire(" in line)


def test_where_a_rank_was_comes_from_its_main_thread_in_a_faulthandler_dump(tmp_path):
    """The dump may be written by any thread (the signal goes to the process): the main thread is found by the
    id the rank wrote first; its frames are named from the script on, as cells when a source map is there."""
    stacks = tmp_path / "rank-0.txt"
    with open(stacks, "w", encoding="utf-8") as file:
        file.write(f"main thread 0x{threading.main_thread().ident:016x}\n")
        file.flush()

        dumped = threading.Event()

        def dump() -> None:  # once the main thread is blocked in the wait below, not on its way there
            main = threading.main_thread().ident
            wait_until(lambda: _blocked_in_event_wait(sys._current_frames()[main]), 60,
                       "the main thread blocked in Event.wait", every=0.001)
            faulthandler.dump_traceback(file, all_threads=True)
            dumped.set()

        def in_the_script() -> None:  # the line below stands for the job's line the rank is on
            threading.Thread(target=dump, daemon=True).start()
            assert dumped.wait(timeout=60)
        in_the_script()
    frames = main_thread_frames(stacks.read_text())
    names = [name for _, _, name in frames]
    test = "test_where_a_rank_was_comes_from_its_main_thread_in_a_faulthandler_dump"
    assert names[-1] == "wait" and names.index("in_the_script") == names.index(test) + 1
    inner, mine = frames[-1], frames[names.index("in_the_script")]
    assert where(frames, __file__) == \
        f"in wait at threading.py:{inner[1]}, from test_warm_departure.py, line {mine[1]}"  # (no source map here)
    assert where(frames[:names.index("in_the_script") + 1], __file__) == f"at test_warm_departure.py, line {mine[1]}"
    assert where(frames, "elsewhere.py") == f"in wait at threading.py:{inner[1]}"
    assert where([], __file__) == ""


def test_a_rank_that_took_a_stopped_job_is_given_a_moment_to_end_it(tmp_path, ranks, monkeypatch):
    """The next run right after an interrupt: a rank that has just taken the stopped job (it ends it at once)
    is waited for, not taken for a rank busy with the job; one that never ends it is, after the wait."""
    monkeypatch.setattr(warm_pool, "STOPPED_JOB_ENDS_WITHIN", 1.0)
    pool = pool_of(tmp_path, ranks(BLOCKED), ranks(BLOCKED))
    end(pool, 0)
    take(pool, 1)
    ending = threading.Timer(0.3, end, (pool, 1))
    ending.start()
    started = time.monotonic()
    assert not pool.busy() and time.monotonic() - started < 1.0
    ending.join()
    pool.dir.job_exit(0, 1).unlink()  # rank 1 took it and never ends it
    started = time.monotonic()
    assert pool.busy() and time.monotonic() - started >= 1.0
