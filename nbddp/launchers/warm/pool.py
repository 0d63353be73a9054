"""The handle on one pool of warm ranks: start them, hand them jobs, ask what they keep, stop them.

A :class:`WarmPool` is nbddp's rank starter (:mod:`nbddp.launchers.warm.agent`) started once with
:mod:`nbddp.rank_side.warm.loop` as its module (or one started ahead, :class:`~nbddp.launchers.warm.preload.Preload`,
handed it); each job it is handed is a :class:`~nbddp.launchers.warm.run.WarmRun`.
Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Mapping

from nbddp.contracts.atomic import write_json
from nbddp.contracts.devices import Devices
from nbddp.launchers.base import Launch
from nbddp.launchers import private_rendezvous
from nbddp.contracts.owned import touch
from nbddp.launchers.local_process import AdoptedGroup, LaunchSpec, LocalProcess
from nbddp.contracts.pool_dir import FOLDER_PREFIX, PoolDir
from nbddp.contracts.process_groups import owned_temp_dir, process_alive
from nbddp.launchers.direct import starter_options
from nbddp.launchers.warm.departure import Departure
from nbddp.launchers.warm.preload import Preload, ranks_environment
from nbddp.launchers.warm.rules import PoolKey
from nbddp.launchers.warm.run import WarmRun
from nbddp.contracts.rank_env import DEFAULT_WARM_IDLE, RankEnv
from nbddp.contracts.interpreter import module_argv

#: Seconds a rank that took a stopped job is given to end it (it does so at once, once scheduled) before the
#: pool is judged busy: the next run right after an interrupt finds the ranks it left.
STOPPED_JOB_ENDS_WITHIN = 3.0


class WarmPool:
    """N warm ranks under one starter, and the jobs handed to them in turn."""

    def __init__(self, key: PoolKey, devices: Devices, idle: float = DEFAULT_WARM_IDLE,
                 environ: Mapping[str, str] | None = None, preload: Preload | None = None) -> None:
        """Start the ranks: their starter under :mod:`nbddp.rank_side.parent_death`, so they die with this process.

        ``environ``: what the ranks inherit (this process's environment by default; a batch passes
        each device slot's own ``CUDA_VISIBLE_DEVICES``). ``preload``: a starter started ahead (alive, and for
        ``key.python``), which is handed the ranks to fork instead.
        """
        self.key, self.devices, self.idle, self.environ = key, devices, idle, environ
        self.dir = preload.dir if preload is not None else PoolDir(owned_temp_dir(FOLDER_PREFIX))
        self.runs = 0
        self.stopped = False
        self.lost = ""
        self.last_used = self.started = time.monotonic()
        if preload is not None:
            self.launch: Launch = preload.launch  # (first: stop() below stops it, should anything fail)
        try:
            starter = [*starter_options(devices.nproc, self.dir.launch_report), "-m", "nbddp.rank_side.warm.loop",
                       str(self.dir)]
            env = ranks_environment(RankEnv(device=devices.kind, nproc=devices.nproc,
                                            collective_timeout=key.collective_timeout, warm=True, warm_idle=idle),
                                    private_rendezvous.prepare(self.dir.store),
                                    os.environ if environ is None else environ)
            if preload is None:
                argv = tuple(module_argv("nbddp.launchers.warm.agent", str(self.dir), *starter, python=key.python))
                self.launch = LocalProcess(LaunchSpec(argv, env, Path(key.cwd), self.dir.launcher_log))
            write_json(self.dir.description, {"key": asdict(key), "idle": idle, "pid": self.launch.pid,
                                              "pgid": self.launch.pgid})
            if preload is not None:
                write_json(self.dir.go, {"argv": starter, "env": env, "cwd": key.cwd, "nproc": devices.nproc})
        except BaseException:
            self.stop()
            raise

    @property
    def folder(self) -> Path:
        return self.dir.path

    @classmethod
    def adopt(cls, folder: Path, devices: Devices) -> "WarmPool":
        """The pool another process started in ``folder`` (a batch, which owns it).

        This process hands it jobs and may stop it (a failed run), but never starts or removes it.

        Raises:
            ValueError: ``folder`` holds no pool's description.
        """
        directory = PoolDir(folder)
        try:
            data = json.loads(directory.description.read_text(encoding="utf-8"))
            key = PoolKey(**data["key"])
            pid, pgid, idle = int(data["pid"]), int(data["pgid"]), float(data["idle"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{folder}: not a warm pool ({exc})") from None
        pool = cls.__new__(cls)
        pool.key, pool.devices, pool.idle, pool.dir, pool.environ = key, devices, idle, directory, None
        pool.runs = directory.jobs_handed_out()
        pool.stopped = False
        pool.lost = ""
        pool.last_used = pool.started = time.monotonic()
        pool.launch = AdoptedGroup(pid, pgid)
        return pool

    def alive(self) -> bool:
        """Running and able to take a job: the starter and every rank that started still there.

        Ranks that left on their own (idle) end before their starter does, which then removes the
        folder: a pool whose folder is gone is not alive, even while the starter finishes.
        """
        if self.stopped or self.launch.poll() is not None or not self.dir.description.exists():
            return False
        return all(process_alive(pid) for pid in self.rank_pids().values())

    def rank_pids(self) -> dict[int, int]:
        """Each rank's pid, from its ready mark (ranks still starting have none)."""
        return self.dir.rank_pids()

    def ready(self) -> bool:
        return self.dir.ready_dir.is_dir() and len(list(self.dir.ready_dir.glob("rank-*"))) == self.devices.nproc

    def startup_note(self) -> str:
        """How far the ranks are: ``ready``, or ``started 1.2s ago``."""
        return "ready" if self.ready() else f"started {time.monotonic() - self.started:.1f}s ago"

    def idle_for(self) -> float:
        return time.monotonic() - self.last_used

    def submit(self, script: Path, rank_env: Mapping[str, str], cwd: Path) -> WarmRun:
        """Hand the ranks their next job; the returned handle stands in for a launcher process."""
        number = self.dir.jobs_handed_out()  # (a post-mortem is a job too, not a run)
        self.runs += 1
        self.last_used = time.monotonic()
        write_json(self.dir.job(number), {"script": str(script), "cwd": str(cwd), "env": dict(rank_env)})
        return WarmRun(self, number)

    def submit_post_mortem(self, rank: int) -> tuple[WarmRun, Path]:
        """Hand the ranks a post-mortem: ``rank`` opens its debugger on the failure it keeps (the others end the job
        at once); the folder its session's channel appears in, for the kernel to relay. (Not a run: the ranks count
        runs without it.)"""
        number = self.dir.jobs_handed_out()
        self.last_used = time.monotonic()
        write_json(self.dir.job(number), {"kind": "debug", "rank": rank})
        return WarmRun(self, number), self.dir.debug_sessions(number)

    def failures(self) -> dict[int, dict]:
        """The failures the ranks keep from their last job (``{rank: {"time", "type", "message", "run_dir"}}``),
        the first failure first."""
        found = {}
        for rank in range(self.devices.nproc):
            try:
                found[rank] = json.loads(self.dir.failure(rank).read_text())
            except (OSError, ValueError):
                continue
        return dict(sorted(found.items(), key=lambda item: item[1].get("time", 0)))

    def endings(self, number: int) -> list[dict | None]:
        """Each rank's report of how it ended job ``number`` (``None``: not yet)."""
        found: list[dict | None] = []
        for rank in range(self.devices.nproc):
            try:
                found.append(json.loads(self.dir.job_exit(number, rank).read_text()))
            except (OSError, ValueError):
                found.append(None)
        return found

    def busy(self) -> bool:
        """A job handed out that not every rank has ended, and that wasn't stopped: the ranks can't take
        another. (Ranks yet to take a stopped job end it the moment they take it.)

        The folder counts the jobs, not :attr:`runs`: a batch's pool gets its jobs from the runs that
        adopt it, so the batch itself learns of a run that died mid-job only there."""
        handed = self.dir.jobs_handed_out()
        endings = self.endings(handed - 1) if handed else []
        if None not in endings:
            return False
        if not self.dir.stopped(handed - 1).exists():
            return True
        # A rank that took the stopped job ends it at once: a moment (a loaded machine's) is waited for.
        deadline = time.monotonic() + STOPPED_JOB_ENDS_WITHIN
        while any(ending is None and self.dir.taken(handed - 1, rank).exists() for rank, ending in enumerate(endings)):
            if time.monotonic() > deadline:
                return True
            time.sleep(0.05)
            endings = self.endings(handed - 1)
        return False

    def kept(self, wait: float = 10.0) -> list[dict | None]:
        """What each rank keeps of the setup (its cells, names and sizes, nbddp's copies; ``None``: nothing said),
        once each has put it back after the last job (waited for up to ``wait`` seconds)."""
        handed, deadline = self.dir.jobs_handed_out(), time.monotonic() + wait
        while True:
            found = []
            for rank in range(self.devices.nproc):
                try:
                    found.append(json.loads(self.dir.kept(rank).read_text()))
                except (OSError, ValueError):
                    found.append(None)
            if all(f is not None and f.get("job", -1) >= handed - 1 for f in found) or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    def forget(self, wait: float = 30.0) -> bool:
        """Ask the (idle) ranks to drop the setup they keep; ``True`` once every rank has."""
        try:
            count = int(self.dir.forget_request.read_text()) + 1
        except (OSError, ValueError):
            count = 1
        write_json(self.dir.forget_request, count)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self.alive():
            if all(self.dir.forgot(count, rank).exists() for rank in range(self.devices.nproc)):
                return True
            time.sleep(0.02)
        return False

    def interrupt(self, number: int) -> None:
        """Stop job ``number``: mark it stopped (a rank yet to take it ends it without running it), then
        interrupt every rank that hasn't ended it (SIGINT: ``KeyboardInterrupt`` in the job only, see
        :mod:`nbddp.rank_side.warm.loop`); the ranks stay, for the next job.

        In this order, and the ranks' pids read after the mark: a rank that isn't ready yet (its pid
        unknown here) takes the job after the mark exists."""
        self.dir.mark(self.dir.stopped(number))
        endings = self.endings(number)
        for rank, pid in self.rank_pids().items():
            if rank < len(endings) and endings[rank] is None:
                try:
                    os.kill(pid, signal.SIGINT)
                except OSError:
                    pass

    def why_not_kept(self) -> str:
        """Why the pool can't take the next job after one that didn't succeed (``""``: it can). The one rule.

        Its ranks must be alive and out of the last job, or on their way out: ranks still leaving a stopped
        job are waited for while they make progress (:class:`nbddp.launchers.warm.departure.Departure`),
        after which a rank that couldn't leave is named, with where it was."""
        if self.lost:
            return self.lost
        if not self.alive():
            return "its ranks had exited"
        handed = self.dir.jobs_handed_out()
        if handed == 0 or None not in self.endings(handed - 1):
            return ""
        if not self.dir.stopped(handed - 1).exists():
            return "its ranks are still in the last job"
        return Departure(self, handed - 1).wait()

    def lose(self, why: str, sig: int = signal.SIGTERM) -> None:
        """Its ranks can't be kept (``why``): stop them, and remember why for whoever asks next."""
        self.lost = why
        self.terminate(sig)

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Stop every rank and the starter (their reports stay readable until :meth:`stop`). Safe to call again."""
        self.stopped = True
        launch = getattr(self, "launch", None)  # (none yet: the pool failed to start before its starter did)
        if launch is not None and (launch.poll() is None or launch.alive()):
            launch.stop(sig)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop every rank and the starter, and remove the pool's folder (its starter removes it too, should
        this process be killed while waiting for it: see :mod:`nbddp.launchers.warm.agent`)."""
        try:
            touch(self.dir.stop_mark)
        except OSError:
            pass
        self.terminate(sig)
        shutil.rmtree(self.folder, ignore_errors=True)
