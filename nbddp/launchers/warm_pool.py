"""Warm ranks, the kernel's side: a pool of ranks kept between runs, and which runs they may serve.

A pool is nbddp's rank starter (:mod:`nbddp.launchers.warm_agent`) started once with
:mod:`nbddp.rank_side.warm_loop` as its module: N spawned rank
processes (never forked, so CUDA in the kernel is no hazard) that import torch, join the process
group and wait. Each run then hands its script to them (:meth:`WarmPool.submit`), which costs a
file write instead of a process start. A run on warm ranks means what a fresh run means: the script
runs with the run's own environment and run dir, and its training starts from the state a fresh
run's setup leaves; the ranks keep the setup cells that didn't change since they ran them
(:mod:`nbddp.rank_side.warm_state`), which :meth:`WarmPool.kept` reads and :meth:`WarmPool.forget` drops.

Three rules decide, and only they: :func:`why_not_warm` (can warm ranks serve this run at all: the
engine, several nodes, Slurm, ``--max-restarts``), :func:`why_fresh` (can *this* pool serve it:
what the ranks were started with, whether they are alive and idle) and :meth:`PoolKeeper.ended`
(after a run that didn't succeed, keyed by its :class:`~nbddp.contracts.status.Status`: the pool is kept
unless :meth:`WarmPool.why_not_kept` says why not). ``%%ddp_train`` keeps one pool per kernel
(:class:`KernelPool`); ``nbddp batch`` one per device slot (a :class:`PoolKeeper` each), which its
runs adopt (:meth:`WarmPool.adopt`, through :data:`POOL_ENV`).

The kernel's death takes the ranks with it (the starter runs under
:mod:`nbddp.rank_side.parent_death`, and removes the pool's folder: :mod:`nbddp.launchers.warm_agent`);
idle ranks exit after ``idle`` seconds. Nothing here imports torch.
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
from typing import TYPE_CHECKING, Mapping

from nbddp.contracts.atomic import write_json
from nbddp.contracts.devices import Devices
from nbddp.engines import spawns_its_own_ranks
from nbddp.contracts.rank_memory import size
from nbddp.contracts.status import Status
from nbddp.launchers.base import Launch
from nbddp.launchers import private_rendezvous
from nbddp.contracts.owned import touch
from nbddp.launchers.local_process import AdoptedGroup, LaunchSpec, LocalProcess
from nbddp.contracts.pool_dir import FOLDER_PREFIX, JobEnd, PoolDir
from nbddp.launchers.process_groups import owned_temp_dir, process_alive
from nbddp.launchers.direct import starter_options
from nbddp.launchers.warm_departure import Departure
from nbddp.plan.options import DEFAULT_WARM_IDLE
from nbddp.contracts.rank_env import RankEnv

if TYPE_CHECKING:
    from nbddp.plan.options import LaunchOptions

#: Set by ``nbddp batch`` for each run: the folder of the warm pool its device slot keeps.
POOL_ENV = "NBDDP_WARM_POOL"
#: Environment variables that differ between runs by design, that nbddp sets per run, or that a library
#: sets in the kernel when imported there: none of them makes warm ranks stale.
_PER_RUN = ("NBDDP_", "JPY_", "PYDEVD_", "TERM", "COLUMNS", "LINES",
            # Set by a library on import (Lightning): a rank that imports it sets them too.
            "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR")


def why_not_warm(engine: str, launch: "LaunchOptions") -> str:
    """Why warm ranks can't serve a run of ``engine`` with ``launch`` (``""``: they can). The one rule."""
    if spawns_its_own_ranks(engine):
        return f"warm ranks can't serve the {engine} engine (it spawns its own ranks)"
    if launch.nodes is not None or launch.slurm is not None or launch.ray is not None:
        return "warm ranks are for one machine"
    if launch.max_restarts:
        return "warm ranks can't be restarted by torchrun (--max-restarts)"
    return ""


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
    """N warm ranks under one starter, and the jobs handed to them in turn."""

    def __init__(self, key: PoolKey, devices: Devices, idle: float = DEFAULT_WARM_IDLE,
                 environ: Mapping[str, str] | None = None) -> None:
        """Start the ranks: their starter under :mod:`nbddp.rank_side.parent_death`, so they die with this process.

        ``environ``: what the ranks inherit (this process's environment by default; a batch passes
        each device slot's own ``CUDA_VISIBLE_DEVICES``).
        """
        self.key, self.devices, self.idle, self.environ = key, devices, idle, environ
        self.dir = PoolDir(owned_temp_dir(FOLDER_PREFIX))
        self.runs = 0
        self.stopped = False
        self.lost = ""
        self.last_used = self.started = time.monotonic()
        store = private_rendezvous.prepare(self.dir.store)
        argv = [key.python, "-m", "nbddp.launchers.warm_agent", str(self.dir),
                *starter_options(devices.nproc, self.dir.launch_report), "-m", "nbddp.rank_side.warm_loop", str(self.dir)]
        environ = os.environ if environ is None else environ
        env = RankEnv(device=devices.kind, nproc=devices.nproc, collective_timeout=key.collective_timeout, warm=True,
                      warm_idle=idle, pool_owner=os.getpid()).to_environ(environ)
        env |= private_rendezvous.environment(store, environ)
        self.launch: Launch = LocalProcess(LaunchSpec(tuple(argv), env, Path(key.cwd), self.dir.launcher_log))
        try:
            write_json(self.dir.description, {"key": asdict(key), "idle": idle, "pid": self.launch.pid,
                                              "pgid": self.launch.pgid})
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
        pids = {}
        for path in self.dir.ready_dir.glob("rank-*"):
            try:
                pids[int(path.name.split("-", 1)[1])] = int(path.read_text())
            except (OSError, ValueError):
                continue
        return pids

    def ready(self) -> bool:
        return self.dir.ready_dir.is_dir() and len(list(self.dir.ready_dir.glob("rank-*"))) == self.devices.nproc

    def startup_note(self) -> str:
        """How far the ranks are: ``ready``, or ``started 1.2s ago``."""
        return "ready" if self.ready() else f"started {time.monotonic() - self.started:.1f}s ago"

    def idle_for(self) -> float:
        return time.monotonic() - self.last_used

    def submit(self, script: Path, rank_env: Mapping[str, str], cwd: Path) -> "WarmRun":
        """Hand the ranks their next job; the returned handle stands in for a launcher process."""
        number = self.runs
        self.runs += 1
        self.last_used = time.monotonic()
        write_json(self.dir.job(number), {"script": str(script), "cwd": str(cwd), "env": dict(rank_env)})
        return WarmRun(self, number)

    def endings(self, number: int) -> list[dict | None]:
        """Each rank's report of how it ended job ``number`` (``None``: not yet)."""
        found: list[dict | None] = []
        for rank in range(self.devices.nproc):
            try:
                found.append(json.loads(self.dir.ended(number, rank).read_text()))
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
        return not self.dir.stopped(handed - 1).exists() or any(
            ending is None and self.dir.taken(handed - 1, rank).exists() for rank, ending in enumerate(endings))

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
        :mod:`nbddp.rank_side.warm_loop`); the ranks stay, for the next job.

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
        job are waited for while they make progress (:class:`nbddp.launchers.warm_departure.Departure`),
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
        if self.launch.poll() is None or self.launch.alive():
            self.launch.stop(sig)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop every rank and the starter, and remove the pool's folder (its starter removes it too, should
        this process be killed while waiting for it: see :mod:`nbddp.launchers.warm_agent`)."""
        try:
            touch(self.dir.stop_mark)
        except OSError:
            pass
        self.terminate(sig)
        shutil.rmtree(self.folder, ignore_errors=True)


class WarmRun:
    """One job on a warm pool: a :class:`nbddp.launchers.Launch` with no process of its own.

    ``poll()`` is ``None`` while the ranks run the job, ``0`` once every rank ended it normally and
    ``1`` once every rank ended it and one failed (its error report is in the run dir), or the
    pool's exit code if it died. When a rank fails, the others are interrupted at once (as torchrun
    stops the survivors of a fresh run); so are all of them when the job is stopped. The job is over
    once every rank has left it or hasn't taken it (it ends it the moment it does); ranks that
    can't leave (:class:`~nbddp.launchers.warm_departure.Departure`: no progress, or still leaving
    after its longest wait) cost the pool, which is stopped.
    """

    def __init__(self, pool: WarmPool, number: int) -> None:
        self.pool, self.number = pool, number
        self.pid, self.pgid = pool.launch.pid, pool.launch.pgid
        self.stopped_by: int | None = None
        self._code: int | None = None
        self._departure: Departure | None = None

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        endings = self.pool.endings(self.number)
        statuses = [ending and ending.get("status") for ending in endings]
        if None not in statuses:
            self._code = 0 if all(s == JobEnd.OK for s in statuses) else 1
            self.pool.last_used = time.monotonic()
        elif self.pool.launch.poll() is not None:
            self._code = self.pool.launch.poll() or 1
        elif self._departure is not None or any(s not in (None, JobEnd.OK) for s in statuses):
            self._interrupt()  # a rank failed (or the job is being stopped): end the job in the others
            why = self._departure.check()
            if why == "":  # the ranks left haven't taken the job: they end it the moment they do
                self._code = 1
            elif why:
                self.pool.lose(why, self.stopped_by or signal.SIGTERM)  # the folder stays until the run is judged
                self._code = -self.stopped_by if self.stopped_by else 1
        return self._code

    def _interrupt(self) -> None:
        if self._departure is None:
            self._departure = Departure(self.pool, self.number)
            self.pool.interrupt(self.number)

    def stop(self, sig: int = signal.SIGTERM, grace: float | None = None, reap: bool = False) -> None:
        """End the job: interrupt it in every rank and wait until each has left it (or hasn't taken it),
        keeping the ranks; stop the pool if they can't leave (or for ``SIGKILL``)."""
        if self.stopped_by is None and not reap:
            self.stopped_by = sig
        if sig == signal.SIGKILL:
            self.pool.terminate(sig)  # the folder stays until the run is judged (retire)
            self._code = -sig
            return
        if self._code is None:
            self._interrupt()
            while self.poll() is None:
                time.sleep(0.01)

    def alive(self) -> bool:
        """True while the ranks work on this job (idle warm ranks don't count: they are the pool's)."""
        return self.poll() is None


def why_fresh(pool: WarmPool, key: PoolKey, idle: float) -> str:
    """Why ``pool`` can't take a run that wants ``key`` (``""``: it can), in a few words. (An edited module of
    the notebook's folder is no reason: the ranks run again the setup cells that import it.)"""
    return (key.differs(pool.key)
            or ("" if pool.alive() else "the warm ranks had exited (idle, or stopped)")
            or ("they are busy with another run" if pool.busy() else "")
            or ("their idle limit changed" if pool.idle != idle else ""))


def ending_note(status: Status) -> str:
    """How the last run ended, when its ranks must be judged before the next (``""``: it succeeded)."""
    status = Status(status)
    return {Status.SUCCEEDED: "", Status.TIMEOUT: "the last run timed out",
            Status.INTERRUPTED: "the last run was interrupted"}.get(status, f"the last run {status}")


def adopt_batch_pool(devices: Devices, cwd: Path, collective_timeout: float | None,
                     environ: Mapping[str, str] | None = None) -> tuple[WarmPool | None, str]:
    """The pool ``nbddp batch`` keeps for this run's device slot (:data:`POOL_ENV`), and a line when
    it can't be used; ``(None, "")`` outside a batch."""
    folder = (os.environ if environ is None else environ).get(POOL_ENV)
    if not folder:
        return None, ""
    try:
        pool = WarmPool.adopt(Path(folder), devices)
    except ValueError:
        why = "they are gone"
    else:
        why = why_fresh(pool, pool_key(devices, cwd, collective_timeout, environ), pool.idle)
    if why:
        return None, f"not on the batch's warm ranks ({why}): starting fresh ones"
    return pool, f"on the batch's warm ranks (this slot's run {pool.runs + 1} on them)"


# ---------------------------------------------------------------- keeping a pool between runs


class PoolKeeper:
    """One pool of warm ranks kept between runs, and the one rule for keeping it after a run.

    After a run that didn't succeed (keyed by its :class:`~nbddp.contracts.status.Status`), the ranks are kept
    when each of them left the job or is on its way out (they rebuild their process group before the
    next one; :meth:`WarmPool.why_not_kept`); otherwise they are stopped, and fresh ones start either at
    once (``replace_at_once``: a kernel's, ready or nearly by the time the cell runs again) or when the
    next run asks (a batch slot's, whose next run comes at once). The next run says what happened.
    """

    def __init__(self, idle: float = DEFAULT_WARM_IDLE, environ: Mapping[str, str] | None = None,
                 replace_at_once: bool = True) -> None:
        self.pool: WarmPool | None = None
        self.idle = idle
        """How long idle ranks wait for the next run before exiting (``%ddp_ranks --idle``)."""
        self.environ = environ
        self.replace_at_once = replace_at_once
        self.last_run = ""
        """How the last run ended, when it didn't succeed (the next run says what that meant for its ranks)."""
        self.replaced = ""
        """Why its ranks could not be kept, when they couldn't."""

    def pool_with(self, key: PoolKey, devices: Devices,
                  environ: Mapping[str, str] | None = None) -> tuple[WarmPool, str]:
        """The warm ranks for a run that wants ``key``, and a line to say how it got them, when there is
        something to say. ``environ``: what new ranks inherit, when not the keeper's (the GPUs a run chose).

        Raises:
            OSError: the ranks could not be started.
        """
        last_run, replaced, self.last_run, self.replaced = self.last_run, self.replaced, "", ""
        why = ""
        if self.pool is not None:
            why = why_fresh(self.pool, key, self.idle)
            if not why:
                if not last_run:
                    return self.pool, ""
                if not replaced:
                    return self.pool, f"{last_run}: on the same warm ranks, in a new process group"
                return self.pool, (f"{last_run} and its warm ranks could not be kept ({replaced}): on fresh ones, "
                                   f"started as it ended ({self.pool.startup_note()})")
            self.stop()
        elif replaced:
            why = f"{last_run} and its warm ranks could not be kept ({replaced})"
        self.pool = self._start(key, devices, environ)
        return self.pool, f"starting fresh warm ranks: {why}" if why else ""

    def _start(self, key: PoolKey, devices: Devices, environ: Mapping[str, str] | None = None) -> WarmPool:
        return WarmPool(key, devices, self.idle, environ=self.environ if environ is None else environ)

    def ended(self, pool: WarmPool, status: Status) -> None:
        """The run on ``pool`` ended with ``status``: after one that didn't succeed, keep the ranks if each
        left the job (or is on its way out), else stop them (and start fresh ones, ``replace_at_once``)."""
        note = ending_note(status)
        if not note or pool is not self.pool:
            return
        self.last_run, self.replaced = note, pool.why_not_kept()
        if self.replaced:
            self.stop()
            if self.replace_at_once:
                self.pool = self._start(pool.key, pool.devices, pool.environ)

    def stop(self) -> bool:
        """Stop the warm ranks; ``False`` if there were none. (Forgotten only once stopped, so that an
        interrupt meanwhile still finds them.)"""
        if self.pool is None:
            return False
        self.pool.stop()
        self.pool = None
        return True


# ---------------------------------------------------------------- the kernel's one pool


class KernelPool(PoolKeeper):
    """``%%ddp_train``'s warm ranks: one pool per kernel (a :class:`nbddp.job.orchestrator.WarmSource`),
    replaced at once when a run's ranks can't be kept, and stopped when the kernel exits."""

    def __init__(self) -> None:
        super().__init__(DEFAULT_WARM_IDLE)
        self._at_exit = False

    def pool_for(self, devices: Devices, cwd: Path, collective_timeout: float | None) -> tuple[WarmPool, str]:
        """The warm ranks for this run, and a line to say how it got them, when there is something to say."""
        environ = {**os.environ, **devices.environment()} if devices.gpu_ids else None  # (--gpus free, --wait)
        return self.pool_with(pool_key(devices, cwd, collective_timeout, environ), devices, environ)

    def _start(self, key: PoolKey, devices: Devices, environ: Mapping[str, str] | None = None) -> WarmPool:
        pool = super()._start(key, devices, environ)
        if not self._at_exit:  # the kernel exiting normally stops its ranks and removes their folder
            import atexit

            atexit.register(self.stop)
            self._at_exit = True
        return pool

    def held_gpus(self) -> tuple[str, ...]:
        """The GPUs this kernel's live warm ranks hold, where a run chose them by name (``--gpus free``)."""
        return self.pool.devices.gpu_ids if self.pool is not None and self.pool.alive() else ()

    def describe(self) -> str:
        """What ``%ddp_ranks`` says about the warm ranks, and what each keeps of the setup."""
        pool = self.pool
        if pool is None or not pool.alive():
            return "no warm ranks: the next %%ddp_train starts them"
        state = "ready" if pool.ready() else "starting"
        lines = [f"{pool.devices.nproc} warm ranks ({pool.devices.describe()}), {state}: {pool.runs} run(s), "
                 f"idle for {pool.idle_for():.0f}s of {pool.idle:.0f}s; starter pid {pool.launch.pid}"]
        for rank, report in enumerate(pool.kept() if pool.runs else []):
            lines.append(f"  rank {rank}: {kept_summary(report) if report else 'nothing kept yet'}")
        return "\n".join(lines)

    def make_room(self) -> str:
        """Before a run starts ranks of its own (``--fresh``, ``--detach``, what warm ranks can't serve): drop the
        setup the warm ranks keep if it holds GPU memory, which the new ranks on the same GPUs may need; a line
        saying so (``""``: nothing to drop)."""
        if self.pool is None or not self.pool.alive() or not self.pool.runs:
            return ""
        gpu = sum(g for report in self.pool.kept(wait=2.0) if report for _, _, g in report.get("names", []))
        if not gpu or not self.pool.forget():
            return ""
        return f"the warm ranks dropped the setup they kept ({size(gpu)} on the GPU) to leave the GPU to this run's ranks"

    def forget(self) -> str:
        """Drop what the warm ranks keep of the setup (``%ddp_ranks forget``): a line saying so."""
        if self.pool is None or not self.pool.alive():
            return "no warm ranks: nothing kept"
        if not self.pool.forget():
            return "the warm ranks did not answer: nothing was dropped (%ddp_ranks restart starts fresh ones)"
        return "the warm ranks dropped the setup they kept: the next %%ddp_train runs every setup cell"


def kept_summary(report: dict, limit: int = 8) -> str:
    """One rank's kept setup in a few words: ``cell 2, cell 3 kept: X 1.05 MB, model 4.1 kB; nbddp's copies 4.1 kB (CPU)``."""
    if not report.get("cells"):
        return "nothing kept" + (f" ({report['note']})" if report.get("note") else "")
    names = report.get("names", [])
    shown = []
    for name, cpu, gpu in names[:limit]:
        sizes = " + ".join(s for s in (size(cpu) if cpu else "", f"{size(gpu)} GPU" if gpu else "") if s)
        shown.append(f"{name} {sizes}".rstrip())
    more = f", and {len(names) - limit} more" if len(names) > limit else ""
    copies = f"; nbddp's copies {size(report['copies'])} (CPU)" if report.get("copies") else ""
    return f"{', '.join(report['cells'])} kept: {', '.join(shown)}{more}{copies}"


#: This process's pool for ``%%ddp_train`` (a kernel has one).
kernel_pool = KernelPool()
