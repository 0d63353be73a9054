"""Keeping a pool of warm ranks between runs: whether *this* pool can take a run, a batch slot's pool that its
runs borrow, and the keepers (one pool each, and the one rule for keeping it after a run that didn't succeed).

``nbddp batch`` keeps a :class:`PoolKeeper` per device slot (:class:`BatchSlots`), and each of its runs borrows its
slot's (:func:`batch_slot`); ``%%ddp_train`` a :class:`KernelPool` per kernel, which the Jupyter door owns
(:data:`nbddp.doors.jupyter.kernel_pool.kernel_pool`). The doors reach them through the launchers' face
(:mod:`nbddp.launchers`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import IO, Mapping

from nbddp.contracts.devices import Devices
from nbddp.contracts.rank_env import DEFAULT_WARM_IDLE, RankEnv, prepares_ranks_ahead
from nbddp.contracts.rank_memory import size
from nbddp.contracts.status import Status
from nbddp.contracts.process_groups import memory_held
from nbddp.launchers.warm.pool import WarmPool
from nbddp.launchers.warm.preload import Preload, ranks_environment
from nbddp.launchers.warm.rules import PoolKey, ending_note, pool_key, why_not_warm
from nbddp.plan.options import LaunchOptions

#: Set by ``nbddp batch`` for each run: the folder of the warm pool its device slot keeps.
POOL_ENV = "NBDDP_WARM_POOL"


def why_fresh(pool: WarmPool, key: PoolKey, idle: float) -> str:
    """Why ``pool`` can't take a run that wants ``key`` (``""``: it can), in a few words. (An edited module of
    the notebook's folder is no reason: the ranks run again the setup cells that import it.)"""
    return (key.differs(pool.key)
            or ("" if pool.alive() else "the warm ranks had exited (idle, or stopped)")
            or ("they are busy with another run" if pool.busy() else "")
            or ("their idle limit changed" if pool.idle != idle else ""))


class PoolKeeper:
    """One pool of warm ranks kept between runs (a :class:`nbddp.job.orchestrator.WarmSource`), and the one rule
    for keeping it after a run.

    A keeper that ``borrows`` a pool (a batch run's: the folder of the pool its device slot keeps, :func:`batch_slot`)
    takes it for a run when it can serve it, and neither starts, replaces nor stops it: the batch owns it.

    After a run that didn't succeed (keyed by its :class:`~nbddp.contracts.status.Status`), the ranks are kept
    when each of them left the job or is on its way out (they rebuild their process group before the
    next one; :meth:`WarmPool.why_not_kept`); otherwise they are stopped, and fresh ones start either at
    once (``replace_at_once``: a kernel's, ready or nearly by the time the cell runs again) or when the
    next run asks (a batch slot's, whose next run comes at once). The next run says what happened.
    """

    def __init__(self, idle: float = DEFAULT_WARM_IDLE, environ: Mapping[str, str] | None = None,
                 replace_at_once: bool = True, borrows: Path | None = None) -> None:
        self.pool: WarmPool | None = None
        self.borrows = borrows
        self.launch: LaunchOptions | None = None
        """The launch options of the last run the ranks served (``%%ddp_exec`` runs on the same ranks with them)."""
        self.notes: list[str] = []
        """What else the run about to start is told of its ranks (a starter started ahead that couldn't serve it)."""
        self.idle = idle
        """How long idle ranks wait for the next run before exiting (``%ddp_ranks --idle``)."""
        self.environ = environ
        self.replace_at_once = replace_at_once
        self.last_run = ""
        """How the last run ended, when it didn't succeed (the next run says what that meant for its ranks)."""
        self.replaced = ""
        """Why its ranks could not be kept, when they couldn't."""

    def pool_for(self, devices: Devices, cwd: Path, launch: LaunchOptions) -> tuple[WarmPool | None, str]:
        """The warm ranks for this run (``None``: a borrowed pool that can't serve it), and a line to say how it got
        them, when there is something to say."""
        environ = {**os.environ, **devices.environment()} if devices.gpu_ids else self.environ  # (--gpus free, --wait)
        key = pool_key(devices, cwd, launch, environ)
        self.notes = []
        if self.borrows is not None:
            return self._borrow(key, devices)
        pool, said = self.pool_with(key, devices, environ)
        self.launch = launch
        return pool, "; ".join(line for line in (said, *self.notes) if line)

    def _borrow(self, key: PoolKey, devices: Devices) -> tuple[WarmPool | None, str]:
        try:
            pool = WarmPool.adopt(self.borrows, devices)
        except ValueError:
            why = "they are gone"
        else:
            why = why_fresh(pool, key, pool.idle)
        if why:
            return None, f"not on the batch's warm ranks ({why}): starting fresh ones"
        return pool, f"on the batch's warm ranks (this slot's run {pool.runs + 1} on them)"

    def held_gpus(self) -> tuple[str, ...]:
        """The GPUs the live warm ranks this keeper started hold, where a run chose them by name (``--gpus free``);
        none for a borrowed pool, whose runs get their slot's GPUs as numbers."""
        return self.pool.devices.gpu_ids if self.pool is not None and self.pool.alive() else ()

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
            self._stop_pool()
        elif replaced:
            why = f"{last_run} and its warm ranks could not be kept ({replaced})"
        self.pool = self._start(key, devices, environ)
        return self.pool, f"starting fresh warm ranks: {why}" if why else ""

    def _start(self, key: PoolKey, devices: Devices, environ: Mapping[str, str] | None = None) -> WarmPool:
        environ = self.environ if environ is None else environ
        return WarmPool(key, devices, self.idle, environ=environ, preload=self._take_preload(key, devices, environ))

    def _take_preload(self, key: PoolKey, devices: Devices, environ: Mapping[str, str] | None) -> Preload | None:
        """A starter started ahead that new ranks for ``key`` are to be forked from (a batch's slots have none)."""
        return None

    def after_run(self, pool: WarmPool, status: Status) -> None:
        """The run on ``pool`` ended with ``status``: after one that didn't succeed, keep the ranks if each
        left the job (or is on its way out), else stop them (and start fresh ones, ``replace_at_once``)."""
        note = ending_note(status)
        if not note or pool is not self.pool:  # (a borrowed pool: the batch that owns it decides)
            return
        self.last_run, self.replaced = note, pool.why_not_kept()
        if self.replaced:
            self._stop_pool()
            if self.replace_at_once:
                self.pool = self._start(pool.key, pool.devices, pool.environ)

    def stop(self) -> bool:
        """Stop the warm ranks; ``False`` if there were none."""
        return self._stop_pool()

    def _stop_pool(self) -> bool:
        """Stop the warm ranks; ``False`` if there were none. (Forgotten only once stopped, so that an
        interrupt meanwhile still finds them.)"""
        if self.pool is None:
            return False
        self.pool.stop()
        self.pool = None
        return True


class KernelPool(PoolKeeper):
    """``%%ddp_train``'s warm ranks: one pool per kernel (a :class:`nbddp.job.orchestrator.WarmSource`),
    replaced at once when a run's ranks can't be kept, and stopped when the kernel exits. Their starter is
    started ahead, when the extension is loaded or the nbddp kernel starts (:meth:`prepare`), so that the first run
    finds torch imported."""

    def __init__(self) -> None:
        super().__init__(DEFAULT_WARM_IDLE)
        self._at_exit = False
        self.preload: Preload | None = None
        """The next pool's starter, started ahead of its first run."""
        self._unsaid = False
        """The starter started ahead was started without a word (by the nbddp kernel), and none said it since."""

    def prepare(self, say: bool = True) -> str:
        """Start the next pool's starter ahead of the first run (``%load_ext nbddp``, ``%ddp_ranks start``; the nbddp
        kernel as it starts, with ``say=False``), unless ranks or a starter are there already, or this kernel doesn't
        prepare ranks ahead (beside a job, whose ranks are the job's own; ``NBDDP_PREPARE_AHEAD=0``:
        :func:`~nbddp.contracts.rank_env.prepares_ranks_ahead`); a line saying what happened (``""``: nothing to say;
        with ``say=False``, only a failure is said). A starter started without a word is said by the next call that
        says (the nbddp kernel's ``%load_ext``), which first starts it again if the kernel no longer fits it (its
        first cells set variables or changed folder)."""
        if not prepares_ranks_ahead() or self.live() is not None:
            return ""
        misfit = self._misfit() if say and self._unsaid else ""
        if misfit:  # (the notebook's first cells set variables, or changed folder, after the kernel started it)
            self.preload.stop()
            self.preload, self._unsaid = None, False
            return f"{self.prepare()}; the one started with this kernel no longer fit: {misfit}"
        if self.preload is None or not self.preload.alive():
            try:
                self.preload = Preload(self.idle)
            except Exception as exc:  # noqa: BLE001 - the extension loads all the same; the first run starts the ranks
                self.preload = None
                return f"could not start the warm ranks' starter ahead ({exc}): the first %%ddp_train starts it"
            self._stop_at_exit()
            self._unsaid = not say
            return (f"preparing warm ranks: their starter imports torch now, in the background, and leaves after "
                    f"{self.idle:g}s without a run (%ddp_ranks stop releases it)") if say else ""
        if not say or not self._unsaid:
            return ""
        self._unsaid = False
        state = "has imported torch" if self.preload.preloaded_in() is not None else "imports torch in the background"
        return (f"preparing warm ranks: their starter, started with this kernel (the nbddp kernel), {state}; it leaves "
                f"after {self.preload.idle:g}s without a run (%ddp_ranks stop releases it)")

    def _misfit(self) -> str:
        """What of this kernel now differs from what the starter started ahead imported with (``""``: nothing, or no
        starter waiting): the first run's own check (:meth:`_take_preload`), with the default devices' ranks."""
        preload = self.preload
        if preload is None or not preload.alive():
            return ""
        ranks_env = ranks_environment(RankEnv(nproc=preload.nproc), preload.dir.store, os.environ)
        return preload.misfit(sys.executable, os.getcwd(), ranks_env, preload.nproc)

    def set_idle(self, seconds: float) -> None:
        """``%ddp_ranks --idle``: the ranks started from now on wait this long; a starter waiting for its first run
        is started again with it."""
        self.idle = seconds
        if self.preload is not None and self.preload.alive() and self.preload.idle != seconds:
            self.preload.stop()
            self.preload = None
            self.prepare()

    def live(self) -> WarmPool | None:
        """The warm ranks, when they are running (``None``: none, or gone: idle too long, or stopped)."""
        return self.pool if self.pool is not None and self.pool.alive() else None

    def _start(self, key: PoolKey, devices: Devices, environ: Mapping[str, str] | None = None) -> WarmPool:
        pool = super()._start(key, devices, environ)
        self._stop_at_exit()
        return pool

    def _take_preload(self, key: PoolKey, devices: Devices, environ: Mapping[str, str] | None) -> Preload | None:
        """The starter started ahead, where it can serve these ranks (else it goes, said in :attr:`notes`, and
        fresh ones start). Taken either way: should the pool fail to start, it stops the starter with it."""
        preload, self.preload = self.preload, None
        if preload is None:
            return None
        ranks_env = ranks_environment(RankEnv(nproc=devices.nproc), preload.dir.store,
                                      os.environ if environ is None else environ)
        why = preload.why_not(key.python, key.cwd, ranks_env, devices.nproc)
        if not why:
            return preload
        preload.stop()
        self.notes.append(f"the warm ranks' starter started ahead could not serve this run ({why}): started a fresh "
                          f"one")
        return None

    def _stop_at_exit(self) -> None:
        if not self._at_exit:  # the kernel exiting normally stops its ranks and removes their folder
            import atexit

            atexit.register(self.stop)
            self._at_exit = True

    def stop(self) -> bool:
        """Stop the warm ranks and a starter started ahead; ``False`` if there were neither (running)."""
        preload, self.preload = self.preload, None
        waiting = preload is not None and preload.alive()
        if preload is not None:
            preload.stop()
        return self._stop_pool() or waiting

    def describe(self) -> str:
        """What ``%ddp_ranks`` says about the warm ranks, and what each keeps of the setup."""
        pool = self.pool
        if pool is None or not pool.alive():
            if self.preload is not None and self.preload.alive():
                return self.preload.describe()
            return "no warm ranks: the next %%ddp_train starts them (%ddp_ranks start prepares them now)"
        state = "ready" if pool.ready() else "starting"
        lines = [f"{pool.devices.nproc} warm ranks ({pool.devices.describe()}), {state}: {pool.runs} run(s), "
                 f"idle for {pool.idle_for():.0f}s of {pool.idle:.0f}s; starter pid {pool.launch.pid}; "
                 f"{size(memory_held(pool.launch.pid))} of memory held (starter and ranks, shared pages counted once)"]
        for rank, report in enumerate(pool.kept() if pool.runs else []):
            lines.append(f"  rank {rank}: {kept_summary(report) if report else 'nothing kept yet'}")
        failures = pool.failures()
        if failures:  # (until the next run: %ddp_debug opens them)
            lines.append("  the last run's failure, kept for %ddp_debug: " + ", ".join(
                f"rank {rank} ({failure.get('type')})" for rank, failure in failures.items()))
        return "\n".join(lines)

    def make_room(self) -> str:
        """Before a run starts ranks of its own (``--fresh``, ``--detach``, what warm ranks can't serve): drop the
        setup the warm ranks keep if it holds GPU memory, which the new ranks on the same GPUs may need; a line
        saying so (``""``: nothing to drop)."""
        if self.pool is None or not self.pool.alive() or not self.pool.runs:
            return ""
        gpu = sum(g for report in self.pool.kept(wait=2.0) if report for _, _, g in report.get("names", []))
        # (%ddp_debug's frames hold GPU memory)
        failures = self.pool.devices.kind == "cuda" and bool(self.pool.failures())
        if not (gpu or failures) or not self.pool.forget():
            return ""
        dropped = f"the setup they kept ({size(gpu)} on the GPU)" if gpu else ""
        dropped += (" and " if dropped else "") + ("the failure they kept for %ddp_debug" if failures else "")
        return f"the warm ranks dropped {dropped} to leave the GPU to this run's ranks"

    def forget(self) -> str:
        """Drop what the warm ranks keep of the setup (``%ddp_ranks forget``): a line saying so."""
        if self.pool is None or not self.pool.alive():
            return "no warm ranks: nothing kept"
        if not self.pool.forget():
            return "the warm ranks did not answer: nothing was dropped (%ddp_ranks restart starts fresh ones)"
        return "the warm ranks dropped the setup they kept: the next %%ddp_train runs every setup cell"


def batch_slot(environ: Mapping[str, str] | None = None) -> PoolKeeper | None:
    """This run's warm ranks when ``nbddp batch`` started it with some: the pool its device slot keeps
    (:data:`POOL_ENV`), borrowed; else ``None``."""
    folder = (os.environ if environ is None else environ).get(POOL_ENV)
    return PoolKeeper(borrows=Path(folder)) if folder else None


def kept_summary(report: dict, limit: int = 8) -> str:
    """One rank's kept setup in a few words: ``cell 2, cell 3 kept: X 1.05 MB, model 4.1 kB; nbddp's copies 4.1 kB
    (CPU)``."""
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


class BatchSlots:
    """``nbddp batch``'s warm ranks: one :class:`PoolKeeper` per device slot, its ranks kept between the slot's runs
    by the rule ``%%ddp_train``'s are kept by, and handed to each run through its environment (:data:`POOL_ENV`)."""

    def __init__(self, engine: str, launch: LaunchOptions, fresh: bool, cwd: Path) -> None:
        self.warm = not fresh and not why_not_warm(engine, launch)
        """Whether the batch's runs can share warm ranks at all (``--fresh``, Catalyst, ``--slurm``: no)."""
        self.cwd = cwd
        self.keepers: dict[int, PoolKeeper] = {}

    def hand_to(self, slot: int, launch: LaunchOptions, visible: int | None, env: dict[str, str],
                log: IO[bytes]) -> None:
        """Give the run about to start on device slot ``slot`` (its ``launch`` and environment ``env``) the slot's
        warm ranks: started for its first run, and again (with a line in the run's ``log`` saying why) when what
        they were started with no longer holds, or when its last run's ranks could not be kept."""
        env.pop(POOL_ENV, None)  # a batch started from a batch run's notebook has pools of its own
        if not self.warm:
            return
        from nbddp.launchers import devices_for

        devices = devices_for(launch, visible=visible)
        keeper = self.keepers.setdefault(slot, PoolKeeper(environ=env, replace_at_once=False))
        keeper.environ = env
        try:
            pool, why = keeper.pool_with(pool_key(devices, self.cwd, launch, env), devices)
        except OSError as exc:  # the run starts its own ranks, and would say why it can't either
            log.write(f"nbddp: could not start warm ranks ({exc}): the run starts its own\n".encode())
            log.flush()
            return
        if why:
            log.write(f"nbddp: {why}\n".encode())
            log.flush()
        env[POOL_ENV] = str(pool.folder)

    def slot_run_ended(self, slot: int, status: Status) -> None:
        """Slot ``slot``'s run ended with ``status``: keep its ranks, or replace them (:meth:`PoolKeeper.after_run`)."""
        keeper = self.keepers.get(slot)
        if keeper is not None and keeper.pool is not None:
            keeper.after_run(keeper.pool, status)

    def stop(self) -> None:
        """Stop every slot's warm ranks (the batch is over, or stopped)."""
        for keeper in self.keepers.values():
            keeper.stop()
