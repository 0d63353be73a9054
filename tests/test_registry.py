"""Live runs (nbddp/job/registry.py): ``nbddp kill`` signals a run's processes only while they are still the run's.

A pid, and so a process group id, is given to a new process once the old one is gone: an entry whose run died
without unregistering (SIGKILL) names, some day, somebody else's process. Real processes: a ``sleep`` in a
session of its own plays that somebody.
"""

from __future__ import annotations

import subprocess
import time

import psutil

from nbddp.contracts.atomic import write_json
from nbddp.job import registry


def _entry(tmp_path, pid: int, created: float) -> registry.LiveRun:
    run = registry.LiveRun("nb-1", str(tmp_path), owner_pid=pid, pgid=pid, started=time.time(), engine="torch",
                           world_size=2, owner="cli", owner_created=created, leader_created=created)
    write_json(run.entry, run.__dict__)
    return run


def test_a_process_that_got_the_runs_pid_since_is_never_signalled(tmp_path):
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        born = psutil.Process(stranger.pid).create_time()
        stale = _entry(tmp_path, stranger.pid, born - 100)  # the run's processes started long before this one
        assert registry.live_runs() == [] and not stale.entry.exists()  # pruned: the group isn't the run's any more
        write_json(stale.entry, stale.__dict__)
        assert registry.kill(stale)
        time.sleep(0.5)
        assert stranger.poll() is None, "nbddp kill signalled a process that only had the run's old pid"
        live = _entry(tmp_path, stranger.pid, born)  # now it is the run's own owner and group
        assert registry.live_runs() == [live]
        assert registry.kill(live) and stranger.wait(5) is not None
        assert not (tmp_path / "stop-requested").is_symlink() and (tmp_path / "stop-requested").exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_an_entry_of_an_older_nbddp_without_start_times_still_works(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        run = _entry(tmp_path, sleeper.pid, 0.0)
        assert registry.live_runs() == [run] and registry.kill(run) and sleeper.wait(5) is not None
    finally:
        sleeper.kill()
        sleeper.wait()
