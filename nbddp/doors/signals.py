"""SIGTERM and SIGHUP as Ctrl-C, for the processes that own a run: ``nbddp run`` / ``nbddp batch`` and a
detached run's supervisor (never a kernel, whose signals are Jupyter's)."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator

from nbddp.contracts.errors import SignalReceived


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP interrupt the run as Ctrl-C does (every rank stopped, exit 128+N), for the
    block's duration: a process that owns its run stops it when ``nbddp kill`` (SIGTERM) or a closed
    terminal (SIGHUP) says so, and records why."""

    def stop(signum: int, frame: object) -> None:
        raise SignalReceived(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
