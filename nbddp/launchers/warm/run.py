"""One job on a pool of warm ranks, followed as a launch is (a :class:`nbddp.launchers.base.Launch`).

The run knows its pool through :class:`RunningPool`, what it reads and asks of it, so that the pool (which
hands out runs) and the run import each other not at all.
"""

from __future__ import annotations

import signal
import time
from typing import Protocol

from nbddp.contracts.pool_dir import JobEnd
from nbddp.launchers.base import Launch
from nbddp.launchers.warm.departure import DepartingPool, Departure


class RunningPool(DepartingPool, Protocol):
    """What a run reads and asks of its pool (:class:`~nbddp.launchers.warm.pool.WarmPool`)."""

    launch: Launch
    last_used: float

    def endings(self, number: int) -> list[dict | None]: ...

    def interrupt(self, number: int) -> None: ...

    def lose(self, why: str, sig: int = signal.SIGTERM) -> None: ...

    def terminate(self, sig: int = signal.SIGTERM) -> None: ...


class WarmRun:
    """One job on a warm pool: a :class:`nbddp.launchers.Launch` with no process of its own.

    ``poll()`` is ``None`` while the ranks run the job, ``0`` once every rank ended it normally and
    ``1`` once every rank ended it and one failed (its error report is in the run dir), or the
    pool's exit code if it died. When a rank fails, the others are interrupted at once (as torchrun
    stops the survivors of a fresh run); so are all of them when the job is stopped. The job is over
    once every rank has left it or hasn't taken it (it ends it the moment it does); ranks that
    can't leave (:class:`~nbddp.launchers.warm.departure.Departure`: no progress, or still leaving
    after its longest wait) cost the pool, which is stopped.
    """

    def __init__(self, pool: RunningPool, number: int) -> None:
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
