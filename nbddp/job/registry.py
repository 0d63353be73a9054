"""Runs that are alive right now, for ``nbddp ps`` and ``nbddp kill``.

Each job writes one small file while it runs (``$NBDDP_STATE_DIR``, default
``~/.local/state/nbddp/live``): who owns it (the ``nbddp run`` process or the
kernel), the job's process group and its run dir. Entries whose processes are
all gone are pruned when listed, so a crash never leaves a ghost behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from nbddp.contracts.atomic import write_json
from nbddp.contracts.errors import UsageError
from nbddp.contracts.process_groups import RECORD_SECONDS, STOP_GRACE, group_alive, process_alive, stop_groups
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.owned import touch


#: Owners that stop their own job on SIGTERM (recording it as interrupted): ``nbddp run``, a detached run's supervisor.
SIGNALLED_OWNERS = ("cli", "detached")
#: An entry that can't be read this long after it was written is damaged, and removed.
DAMAGED_AFTER_SECONDS = 60.0


def state_dir() -> Path:
    root = os.environ.get("NBDDP_STATE_DIR") or Path.home() / ".local" / "state" / "nbddp"
    path = Path(root) / "live"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


@dataclass(frozen=True)
class LiveRun:
    name: str
    run_dir: str
    owner_pid: int
    pgid: int
    started: float
    engine: str
    world_size: int
    owner: str = "cli"
    """``cli``: an ``nbddp run`` process, asked to stop its own job (``detached``: a detached run's
    supervisor, the same). ``kernel``: a Jupyter kernel, which is never signalled; its job's processes
    are stopped directly."""
    owner_created: float = 0.0
    """When the owner process started (psutil's ``create_time``): a process given its pid since is not it."""
    leader_created: float = 0.0
    """When the job's process group leader (the launcher, pid ``pgid``) started, likewise."""
    stop_grace: float = STOP_GRACE
    """Its launcher's :attr:`~nbddp.launchers.base.Launcher.stop_grace`: how long ``nbddp kill`` gives it (a Slurm
    watcher cancels the job and waits for the queue to let it go, the Ray driver stops each rank's actor)."""

    @property
    def entry(self) -> Path:
        return state_dir() / f"{self.name}.json"

    def owner_is_alive(self) -> bool:
        """The owner still runs: its pid is alive *and* is still the process that registered the run."""
        return _same_process(self.owner_pid, self.owner_created)

    def group_is_alive(self) -> bool:
        """Some process of the job's group still runs, and the group is still the job's: a pid (and so a group
        id) is reused once its process and group are gone, and a group whose leader is a process started since
        belongs to someone else."""
        return group_alive(self.pgid) and (not process_alive(self.pgid)
                                           or _same_process(self.pgid, self.leader_created))


def _same_process(pid: int, created: float) -> bool:
    """``pid`` runs and started at ``created`` (0: not recorded, an entry of an older nbddp: only alive)."""
    import psutil

    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and (not created or abs(process.create_time() - created) < 1.0)
    except psutil.Error:
        return False


def _created(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def register(run_dir: Path, pgid: int, engine: str, world_size: int, owner: str = "cli",
             stop_grace: float = STOP_GRACE) -> LiveRun:
    run = LiveRun(Path(run_dir).name, str(run_dir), os.getpid(), pgid, time.time(), engine, world_size, owner,
                  owner_created=_created(os.getpid()), leader_created=_created(pgid), stop_grace=stop_grace)
    write_json(run.entry, run.__dict__)
    return run


def unregister(run: LiveRun) -> None:
    run.entry.unlink(missing_ok=True)


def live_runs() -> list[LiveRun]:
    """Registered runs with a live process; entries of runs whose processes are all gone are removed.

    Entries are written whole (:mod:`nbddp.contracts.atomic`), so one that can't be read is damaged, not
    half-written: it is skipped, and removed once it is older than :data:`DAMAGED_AFTER_SECONDS`.
    """
    runs = []
    for entry in sorted(state_dir().glob("*.json")):
        try:
            run = LiveRun(**json.loads(entry.read_text(encoding="utf-8")))
        except FileNotFoundError:
            continue  # unregistered meanwhile
        except (OSError, ValueError, TypeError):
            _remove_if_old(entry)
            continue
        if run.group_is_alive():
            runs.append(run)
        else:
            entry.unlink(missing_ok=True)
    return runs


def _remove_if_old(entry: Path) -> None:
    try:
        if time.time() - entry.stat().st_mtime > DAMAGED_AFTER_SECONDS:
            entry.unlink(missing_ok=True)
    except OSError:
        pass


def find(which: str) -> LiveRun:
    """A live run by its name, its run dir (as a path, relative or not: what a run prints) or its process group."""
    path = Path(which).expanduser().resolve()
    for run in live_runs():
        if which in (run.name, str(run.pgid)) or path == Path(run.run_dir).resolve():
            return run
    raise UsageError(f"no live run {which!r}. `nbddp ps` lists the runs alive now.")


def kill(run: LiveRun) -> bool:
    """End a run: ask its owner to stop it (recorded as interrupted), giving it its launcher's stop grace and
    :data:`~nbddp.contracts.process_groups.RECORD_SECONDS`, else stop its processes.

    Returns True when nothing of the run is left.
    """
    paths = RunDir(Path(run.run_dir))
    if not run.group_is_alive():  # ended meanwhile, or its group id now is someone else's: nothing to signal
        unregister(run)
        return True
    touch(paths.stop_mark)  # the owner records the run as interrupted, not failed
    # A cluster's launcher (Slurm's watcher, the Ray driver) stops the job and waits until it is gone.
    grace = run.stop_grace + RECORD_SECONDS
    if run.owner in SIGNALLED_OWNERS and run.owner_is_alive() and run.owner_pid != os.getpid():
        os.kill(run.owner_pid, signal.SIGTERM)  # nbddp run stops its ranks and kernel itself
        deadline = time.monotonic() + grace
        while run.group_is_alive() and time.monotonic() < deadline:  # its owner stops it, recording why
            time.sleep(0.1)
    if run.group_is_alive():
        stop_groups([run.pgid], grace=run.stop_grace)
    gone = not run.group_is_alive()
    if gone:
        unregister(run)
    return gone
