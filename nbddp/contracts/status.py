"""How a run ended, and the exit code each ending means: said once.

``result.json``'s ``status``, the exit code of ``nbddp run`` / ``nbddp batch`` and the class of
the exception a failed run raises (:mod:`nbddp.contracts.errors`) are all read from here.
"""

from __future__ import annotations

import signal
from enum import Enum

_CODES = {"succeeded": 0, "failed": 1, "timeout": 124, "interrupted": 128 + signal.SIGINT}


def signal_exit_code(signum: int) -> int:
    """What a shell sees when a process ends because of signal ``signum`` (``128 + N``)."""
    return 128 + int(signum)


class Status(str, Enum):
    """How a run ended; its value is what ``result.json`` says, its exit code what shells see."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"

    @property
    def exit_code(self) -> int:
        """0, 1, 124 (a time limit, as ``timeout(1)``), 130 (interrupted by SIGINT)."""
        return _CODES[self.value]

    def code(self, signum: int | None = None) -> int:
        """The exit code, an interruption by signal ``signum`` exiting ``128 + signum``."""
        return signal_exit_code(signum) if self is Status.INTERRUPTED and signum else self.exit_code

    def __str__(self) -> str:
        return self.value


class BatchState(str, Enum):
    """Where a run of a batch is: not yet started, running, skipped (``--resume``), or its ending."""

    PENDING = "pending"
    RUNNING = "running"
    SKIPPED = "skipped"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"

    @property
    def finished(self) -> bool:
        return self not in (BatchState.PENDING, BatchState.RUNNING)

    @property
    def ok(self) -> bool:
        """Succeeded now or before (a skipped run had succeeded)."""
        return self in (BatchState.SUCCEEDED, BatchState.SKIPPED)

    def __str__(self) -> str:
        return self.value
