"""Warm ranks for ``%%ddp_train``: the kernel's side. One pool of ranks per kernel, kept between runs.

The first run starts torchrun with :mod:`nbddp.rank_side.warm_loop` as its script: N spawned rank processes
(never forked, so CUDA in the kernel is no hazard) that import torch, join the process group and
wait. Each run then hands its script to them (:meth:`WarmPool.submit`), which costs a file write
instead of a process start. A run on warm ranks means what a fresh run means: the script runs in
a fresh namespace with the run's own environment and run dir.

The pool is torn down, and the next run starts fresh ranks, when what the ranks were started
with no longer holds (:class:`PoolKey`: devices, world size, environment, the notebook's local
modules) or when a run did not succeed. The kernel's death takes the ranks with it (torchrun
runs under :mod:`nbddp.launchers.parent_death`); idle ranks exit after ``idle`` seconds.

Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from nbddp.devices import Devices
from nbddp.launchers.local_process import Launch, LaunchSpec
from nbddp.launchers.process_groups import group_alive, owned_temp_dir, process_alive, stop_groups
from nbddp.rank_side.env import RankEnv
from nbddp.job.rundir import RunDir
from nbddp.rank_side.warm_loop import write_json

DEFAULT_IDLE_SECONDS = 600.0
FOLDER_PREFIX = "nbddp-warm-"
#: In a pool's folder: what it was started with, for a process that adopts it (:meth:`WarmPool.adopt`).
POOL_FILE = "pool.json"
#: Set by ``nbddp batch`` for each run: the folder of the warm pool its device slot keeps.
POOL_ENV = "NBDDP_WARM_POOL"
#: Environment variables that differ between runs by design, or that nbddp sets per run.
_PER_RUN = ("NBDDP_", "JPY_", "PYDEVD_", "TERM", "COLUMNS", "LINES")


@dataclass(frozen=True)
class PoolKey:
    """What warm ranks were started with: when any of it changes, they must start again."""

    device: str
    nproc: int
    python: str
    cwd: str
    environment: str
    """A digest of the environment the ranks inherited (per-run variables left out)."""
    collective_timeout: float | None

    def differs(self, other: "PoolKey") -> str:
        """What changed, in a few words (``""``: nothing)."""
        if (self.device, self.nproc) != (other.device, other.nproc):
            return f"the devices changed ({other.nproc} {other.device} → {self.nproc} {self.device})"
        if self.python != other.python:
            return "the Python interpreter changed"
        if self.cwd != other.cwd:
            return "the working folder changed"
        if self.environment != other.environment:
            return "environment variables changed"
        if self.collective_timeout != other.collective_timeout:
            return "--collective-timeout changed"
        return ""


def pool_key(devices: Devices, cwd: Path, collective_timeout: float | None,
             environ: Mapping[str, str] | None = None) -> PoolKey:
    environ = os.environ if environ is None else environ
    kept = sorted((k, v) for k, v in environ.items() if not k.startswith(_PER_RUN))
    digest = hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:16]
    return PoolKey(devices.kind, devices.nproc, sys.executable, str(Path(cwd).resolve()), digest, collective_timeout)


class WarmPool:
    """N warm ranks under one torchrun, and the jobs handed to them in turn."""

    def __init__(self, key: PoolKey, devices: Devices, idle: float = DEFAULT_IDLE_SECONDS,
                 environ: Mapping[str, str] | None = None) -> None:
        """Start the ranks: torchrun under :mod:`nbddp.launchers.parent_death`, so they die with this process.

        ``environ``: what the ranks inherit (this process's environment by default; a batch passes
        each device slot's own ``CUDA_VISIBLE_DEVICES``).
        """
        from nbddp.launchers.torchrun import Torchrun

        self.key, self.devices, self.idle = key, devices, idle
        self.folder = Path(owned_temp_dir(FOLDER_PREFIX))
        self.runs = 0
        self.stopped = False
        self.started_at = time.monotonic()
        self.last_used = self.started_at
        self.local_modules: dict[str, float] = {}
        paths = RunDir(self.folder)
        entry = self.folder / "warm_rank.py"
        entry.write_text("import sys\nfrom pathlib import Path\nfrom nbddp.rank_side.warm_loop import main\n\n"
                         "if __name__ == '__main__':\n    sys.exit(main(Path(sys.argv[1])))\n")
        argv = Torchrun().command(entry, devices, paths, python=key.python) + [str(self.folder)]
        env = RankEnv(None, devices.kind, devices.nproc, None, key.collective_timeout).to_environ(
            os.environ if environ is None else environ)
        env |= {"NBDDP_WARM": "1", "NBDDP_WARM_IDLE": str(idle)}
        self.launch: Launch | _Adopted = Launch(LaunchSpec(tuple(argv), env, Path(key.cwd), paths.launcher_log))
        try:
            write_json(self.folder / POOL_FILE, {"key": asdict(key), "idle": idle, "pid": self.launch.pid,
                                                 "pgid": self.launch.pgid})
        except BaseException:
            self.stop()
            raise

    @classmethod
    def adopt(cls, folder: Path, devices: Devices) -> "WarmPool":
        """The pool another process started in ``folder`` (an ``nbddp run`` of a batch, which owns it).

        This process hands it jobs and may stop it (a failed run), but never starts or removes it.

        Raises:
            ValueError: ``folder`` holds no pool's description.
        """
        try:
            data = json.loads((Path(folder) / POOL_FILE).read_text(encoding="utf-8"))
            key = PoolKey(**data["key"])
            pid, pgid, idle = int(data["pid"]), int(data["pgid"]), float(data["idle"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{folder}: not a warm pool ({exc})") from None
        pool = cls.__new__(cls)
        pool.key, pool.devices, pool.idle, pool.folder = key, devices, idle, Path(folder)
        pool.runs = len(list((pool.folder / "jobs").glob("*.json")))
        pool.stopped = False
        pool.started_at = pool.last_used = time.monotonic()
        pool.local_modules = {}
        pool.launch = _Adopted(pid, pgid)
        return pool

    def alive(self) -> bool:
        """Running and able to take a job: torchrun and every rank that started still there."""
        if self.stopped or self.launch.poll() is not None:
            return False
        return all(process_alive(pid) for pid in self._rank_pids())

    def _rank_pids(self) -> list[int]:
        pids = []
        for path in (self.folder / "ready").glob("rank-*"):
            try:
                pids.append(int(path.read_text()))
            except (OSError, ValueError):  # being written
                continue
        return pids

    def ready(self) -> bool:
        return len(list((self.folder / "ready").glob("rank-*"))) == self.devices.nproc \
            if (self.folder / "ready").is_dir() else False

    def idle_for(self) -> float:
        return time.monotonic() - self.last_used

    def submit(self, script: Path, env: Mapping[str, str], cwd: Path) -> "WarmRun":
        """Hand the ranks their next job; the returned handle stands in for a launcher process."""
        number = self.runs
        self.runs += 1
        self.last_used = time.monotonic()
        write_json(self.folder / "jobs" / f"{number}.json", {
            "script": str(script), "cwd": str(cwd), "env": {k: v for k, v in env.items() if k.startswith("NBDDP_")}})
        return WarmRun(self, number)

    def busy(self) -> bool:
        """A job handed out that not every rank has ended: the ranks can't take another."""
        last = self.runs - 1
        return last >= 0 and not all((self.folder / "ended" / f"{last}-{rank}.json").exists()
                                     for rank in range(self.devices.nproc))

    def note_modules(self) -> None:
        """Learn the local modules the ranks imported, from every job's end report (a batch reads
        them after each run, since its runs hand out the jobs)."""
        for path in (self.folder / "ended").glob("*.json"):
            try:
                self.local_modules.update(json.loads(path.read_text()).get("modules", {}))
            except (OSError, ValueError, AttributeError):
                continue

    def stale_modules(self) -> list[str]:
        """Local modules the ranks imported that were edited (or removed) since."""
        changed = []
        for path, mtime in self.local_modules.items():
            try:
                if os.stat(path).st_mtime != mtime:
                    changed.append(Path(path).name)
            except OSError:
                changed.append(Path(path).name)
        return changed

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Stop every rank and torchrun (their reports stay readable until :meth:`stop`). Safe to call again."""
        self.stopped = True
        if self.launch.poll() is None or self.launch.alive():
            self.launch.stop(sig)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop every rank and torchrun, and remove the pool's folder."""
        self.terminate(sig)
        shutil.rmtree(self.folder, ignore_errors=True)


class _Adopted:
    """The launcher process of a pool another process started: polled and stopped by pid and group."""

    def __init__(self, pid: int, pgid: int) -> None:
        self.pid, self.pgid = pid, pgid

    def poll(self) -> int | None:
        return None if process_alive(self.pid) else 1  # not our child: its exit code is the owner's to read

    def alive(self) -> bool:
        return group_alive(self.pgid)

    def stop(self, sig: int = signal.SIGTERM, grace: float = 5.0, reap: bool = False) -> None:
        stop_groups([self.pgid], sig, grace)


class WarmRun:
    """One job on a warm pool, with the interface :class:`nbddp.job.lifecycle.Job` uses for a launcher process.

    ``poll()`` is ``None`` while the ranks run the job, ``0`` once every rank ended it normally,
    ``1`` when one failed (its error report is in the run dir) and the pool's exit code if it died.
    """

    def __init__(self, pool: WarmPool, number: int) -> None:
        self.pool, self.number = pool, number
        self.pgid = pool.launch.pgid
        self.stopped_by: int | None = None
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        ended = [self.pool.folder / "ended" / f"{self.number}-{rank}.json" for rank in range(self.pool.devices.nproc)]
        statuses = []
        for path in ended:
            try:
                report = json.loads(path.read_text())
                statuses.append(report["status"])
                self.pool.local_modules.update(report.get("modules", {}))
            except (OSError, ValueError, KeyError):
                statuses.append(None)
        if "failed" in statuses:
            self._code = 1  # the others may wait in a collective for it: the pool is torn down
        elif all(s == "ok" for s in statuses):
            self._code = 0
            self.pool.last_used = time.monotonic()
        elif self.pool.launch.poll() is not None:
            self._code = self.pool.launch.poll() or 1
        return self._code

    def stop(self, sig: int = signal.SIGTERM, grace: float | None = None, reap: bool = False) -> None:
        if self.stopped_by is None and not reap:
            self.stopped_by = sig
        self.pool.terminate(sig)  # the folder stays until the run is judged (warm_pool.retire)
        if self._code is None:
            self._code = -sig

    def alive(self) -> bool:
        """True while the ranks work on this job (idle warm ranks don't count: they are the pool's)."""
        return self.poll() is None


# ---------------------------------------------------------------- the kernel's one pool

_current: WarmPool | None = None
_fresh_because = ""
"""Why the next run can't use the current ranks although nothing else changed (the last run failed)."""


def acquire(devices: Devices, engine: str, cwd: Path, collective_timeout: float | None, *, multi_node: bool = False,
            restarts: int = 0, idle: float = DEFAULT_IDLE_SECONDS) -> tuple[WarmPool | None, str]:
    """The warm ranks for this run, and a line to say when they had to be (re)started or can't serve it.

    ``(None, note)``: this run starts fresh ranks the usual way.
    """
    global _current, _fresh_because
    if engine != "torch":
        return None, "warm ranks serve the torch engine only (Catalyst spawns its own ranks): starting fresh ones"
    if multi_node:
        return None, "warm ranks are for one machine: starting fresh ones on every node"
    if restarts:
        return None, "warm ranks can't be restarted by torchrun (--max-restarts): starting fresh ones"
    key = pool_key(devices, cwd, collective_timeout)
    why = _fresh_because
    if _current is not None:
        why = why_fresh(_current, key, idle, _fresh_because)
        if not why:
            return _current, ""
        _current.stop()
    _fresh_because = ""
    _current = WarmPool(key, devices, idle)
    _stop_at_exit()
    return _current, f"starting fresh warm ranks: {why}" if why else ""


def why_fresh(pool: WarmPool, key: PoolKey, idle: float, last_run: str = "") -> str:
    """Why ``pool`` can't take a run that wants ``key`` (``""``: it can), in a few words.

    ``last_run``: why the last run on it means it can't (it failed, was interrupted...).
    """
    stale = pool.stale_modules()
    return (key.differs(pool.key) or last_run
            or (f"{', '.join(stale)} changed" if stale else "")
            or ("" if pool.alive() else "the warm ranks had exited (idle, or stopped)")
            or ("they are busy with another run" if pool.busy() else "")
            or ("their idle limit changed" if pool.idle != idle else ""))


def _stop_at_exit() -> None:
    """The kernel exiting normally stops its ranks and removes their folder (were it killed, the
    ranks die with it anyway, and the next pool removes the folder)."""
    import atexit

    if not getattr(_stop_at_exit, "registered", False):
        atexit.register(stop_current)
        _stop_at_exit.registered = True  # type: ignore[attr-defined]


def retire(reason: str) -> None:
    """The last run on the current ranks did not succeed: the next run starts fresh ones."""
    global _current, _fresh_because
    if _current is not None:
        _current.stop()
        _current = None
        _fresh_because = reason


def current() -> WarmPool | None:
    return _current


def describe() -> str:
    """What ``%ddp_ranks`` says about the warm ranks."""
    pool = _current
    if pool is None or not pool.alive():
        return ("no warm ranks: the next %%ddp_train starts them" +
                (f" ({_fresh_because})" if _fresh_because else ""))
    state = "ready" if pool.ready() else "starting"
    return (f"{pool.devices.nproc} warm ranks ({pool.devices.describe()}), {state}: {pool.runs} run(s), "
            f"idle for {pool.idle_for():.0f}s of {pool.idle:.0f}s; torchrun pid {pool.launch.pid}")


def stop_current() -> bool:
    """Stop the warm ranks (``%ddp_ranks stop``, the kernel exiting); ``False`` if there were none."""
    global _current
    if _current is None:
        return False
    _current.stop()
    _current = None
    return True
