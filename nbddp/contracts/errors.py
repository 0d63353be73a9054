"""The few exceptions nbddp raises on purpose.

Every message says what went wrong *and what to do next*, naming the notebook,
the cell (``cell N``, counted from 1 in notebook order, markdown cells
included) and the line where one is known. ``exit_code`` is what the CLI exits
with, so that scripts and CI can tell bad input (2) from a bad device request
(3), a failed run (1), a timeout (124) and an interrupt (130/143).
"""

from __future__ import annotations

import signal
from typing import Any

from nbddp.contracts.status import Status


def exception_line(exc: BaseException, limit: int = 1000) -> str:
    """``Type: the first line of its message``: how a warning names an exception that it reports and goes past (a
    tracker's, a store's), without its traceback. Whole, up to ``limit`` characters (a library's line often ends with
    what to do: MLflow's refusal of a folder store names ``MLFLOW_ALLOW_FILE_STORE=true`` in its 500th character);
    beyond, cut at a word with ``…``."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if len(first) > limit:
        first = first[:limit].rsplit(" ", 1)[0] + " …"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


#: Where an error's line is explained: the documentation's troubleshooting page, named relative to the project (no
#: host), as ``see: docs/troubleshooting.md#no-training-cell``.
SEE = "see: docs/troubleshooting.md#"


def see(anchor: str) -> str:
    """`` (see: docs/troubleshooting.md#ANCHOR)``, for the end of an error's line (``tests/test_docs.py`` checks that
    every anchor given is a heading there)."""
    return f" ({SEE}{anchor})"


class NbddpError(Exception):
    """Base class: an error the user can act on. Never a bug in nbddp."""

    exit_code: int = 1

    def __reduce__(self) -> tuple[Any, ...]:  # keep subclasses picklable whatever their __init__
        return (self.__class__, self.args)

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for it: the message, not nbddp's own stack (ipyparallel's trick).

        The rank's traceback, translated to notebook cells, is already in the message.
        """
        lines = str(self).splitlines() or [""]
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {lines[0]}", *lines[1:]]


class NotebookError(NbddpError):
    """The notebook can't be read or has nothing to train (bad input, before launch)."""

    exit_code = 2


class CellError(NbddpError):
    """An exported cell can't become script code: syntax error or IPython-only syntax."""

    exit_code = 2


class CellSyntaxError(CellError):
    """An exported cell isn't valid Python: the kernel would refuse it too. ``cell``: its number."""

    def __init__(self, message: str, cell: int | None = None) -> None:
        super().__init__(message)
        self.cell = cell

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (*self.args, self.cell))


class ParameterError(NbddpError):
    """A ``-p NAME VALUE`` pair (or a parameter grid entry) is unusable."""

    exit_code = 2


class UsageError(NbddpError):
    """An option can't be honoured as given (a run dir that holds another run, a bad number)."""

    exit_code = 2


class DeviceError(NbddpError):
    """The requested devices don't exist here (checked before anything starts)."""

    exit_code = 3


#: What a run's outcome says about the exception that ended it, as :class:`RunError` attributes and as
#: ``result.json``'s ``failure``: the ``rank`` that raised it (``None``: a kernel cell), the exception's type
#: and message (``exc_type``, ``exc_message``), and the notebook ``cell`` and ``line``.
JUDGED = ("rank", "exc_type", "exc_message", "cell", "line")


class RunError(NbddpError):
    """A run that didn't succeed, carrying its judged outcome (not only a message), picklable.

    ``status`` (``failed``/``timeout``/``interrupted``), ``exit_code``, the failing ``rank``, the
    exception it raised (``exc_type``, ``exc_message``), the notebook ``cell`` and ``line``, and the
    ``run_dir``; each ``None`` where it isn't known.
    """

    status = Status.FAILED
    FIELDS = ("exit_code", *JUDGED, "run_dir")
    """Every attribute besides the message: what pickling and re-raising it elsewhere must carry."""

    def __init__(self, message: str, *, exit_code: int | None = None, rank: int | None = None,
                 exc_type: str | None = None, exc_message: str | None = None, cell: int | None = None,
                 line: int | None = None, run_dir: str | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        self.rank, self.exc_type, self.exc_message = rank, exc_type, exc_message
        self.cell, self.line, self.run_dir = cell, line, run_dir

    def judged(self) -> dict[str, Any] | None:
        """The :data:`JUDGED` fields, for ``result.json``; ``None`` when none is known (an interruption)."""
        values = {name: getattr(self, name) for name in JUDGED}
        return values if any(value is not None for value in values.values()) else None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.__class__, self.args, {k: getattr(self, k) for k in self.FIELDS}))


def _rebuild(cls: type, args: tuple, fields: dict) -> RunError:
    return cls(*args, **fields)


class RunFailed(RunError):
    """A rank failed; the message carries its error translated to the notebook."""

    exit_code = 1


class RunTimeout(RunError):
    """The run exceeded a time limit (``--timeout``, ``--idle-timeout``, a collective); every rank was stopped."""

    status = Status.TIMEOUT
    exit_code = Status.TIMEOUT.exit_code


class RunInterrupted(RunError):
    """The run was interrupted (a signal, the stop button, ``nbddp kill``); every rank was stopped."""

    status = Status.INTERRUPTED
    exit_code = Status.INTERRUPTED.exit_code


def error_for(status: str, message: str, exit_code: int | None = None, run_dir: str | None = None,
              **judged: Any) -> RunError:
    """The error of a run that ended with ``status`` (``failed``, ``timeout``, ``interrupted``); ``judged``:
    what its outcome knows (the :data:`JUDGED` fields)."""
    cls = {Status.TIMEOUT: RunTimeout, Status.INTERRUPTED: RunInterrupted}.get(Status(status), RunFailed)
    return cls(message, exit_code=exit_code, run_dir=run_dir, **judged)


class CheckpointError(NbddpError):
    """The returned weights could not be written, read or loaded into the kernel."""

    exit_code = 1


class SignalReceived(BaseException):
    """Raised in the main thread by the CLI's SIGTERM/SIGHUP handlers (SIGINT raises KeyboardInterrupt):
    like a Ctrl-C, it stops every rank, and the run ends interrupted with exit code ``128 + signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stop_signal(exc: BaseException) -> int:
    """The signal that ``exc`` stands for, to record and to pass on to the processes a stopped run or batch
    owns: a :class:`SignalReceived`'s own, SIGINT for a ``KeyboardInterrupt`` (the user's Ctrl-C), SIGTERM
    for anything else."""
    if isinstance(exc, SignalReceived):
        return exc.signum
    return signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM
