"""Ranks forked from a starter that imported torch once: what ``python -u PROGRAM`` would do, without each
rank importing torch again.

Every rank's first act is ``import torch`` (about 2 CPU-seconds and 2 s on this kind of machine, 1.3 GB read
from the same files by every rank). Imported once in the starter (:mod:`nbddp.launchers.direct_main`) and
forked, a 2-rank run costs one import instead of two: half the CPU time of starting (what decides a busy
machine's wall time), the ranks start in milliseconds once it is done, and their torch pages are shared.

A forked rank is made to be what a fresh ``python -u PROGRAM`` with the same environment is, where the
program can tell: a session of its own (as ``Popen(start_new_session=True)``), standard input from
``/dev/null``, no other inherited file descriptor (``close_fds``), its own environment, default signal
dispositions, unbuffered standard streams, ``sys.argv``/``sys.path``/``__main__`` as the interpreter nbddp
starts sets them (:func:`nbddp.contracts.interpreter.program_argv`: no folder of the notebook's first on the path),
fresh random seeds (Python's :mod:`random` reseeds itself after a fork; NumPy's global generator is reseeded
here), and an exit that waits for non-daemon threads, runs ``atexit`` handlers and reports an
exception, ``SystemExit`` or Ctrl-C as the interpreter does. What stays the starter's: the hash seed (set
iteration order) and ``sys.orig_argv``.

Why a fork is safe here: the starter runs no Python thread when it forks (where one runs, ranks start as
fresh interpreters), ``OMP_NUM_THREADS`` is set before torch is imported (torch's OpenMP pool starts on first
use, never here; OpenBLAS, where NumPy's starts one, stops it across a fork), it never initialises CUDA
(torch's CUDA is lazy: a rank initialises its own), and it forks before it installs signal handlers or opens
anything but inherited descriptors. Elsewhere than Linux (macOS's system libraries are not fork-safe) the ranks are
started as fresh interpreters.
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import io
import os
import signal
import subprocess
import sys
import threading
import traceback
import types
from typing import Mapping, Sequence

from nbddp.rank_side.parent_death import die_with_parent
from nbddp.contracts.interpreter import has_safe_path, program_argv

#: Where ranks are forked rather than started afresh.
FORKS = sys.platform.startswith("linux")
#: What a DDP rank imports besides torch, preloaded by a starter: torch.distributed and nbddp's rank side (milliseconds,
#: once torch is in). Not ``nbddp.runtime``: importing it makes a rank.
RANK_IMPORTS = ("torch.distributed", "torch.distributed.nn.functional", "nbddp.rank_side.torch_engine",
                "nbddp.rank_side.process")
#: What DDP's constructor imports besides (torch._dynamo and sympy: 1.1 s here): a warm pool's starter started ahead
#: imports it in the background; a fresh run's starter doesn't, being on the run's path, where a job that builds no
#: DDP would wait for it, and its ranks would import it at the same time anyway.
DDP_IMPORTS = ("torch._dynamo",)

def preload(threads: str, modules: Sequence[str] = ()) -> None:
    """Import what every rank imports first, with the ranks' ``OMP_NUM_THREADS`` (``threads``, unless the
    user set it) in place beforehand: libgomp and OpenBLAS size their thread pools from it as they load, so a
    starter that imported torch under another value would fork ranks with the wrong pools (and threads).

    ``modules``: more modules to import after torch (a warm pool's starter preloads what its ranks will import:
    imported here once rather than by every rank, each doing the whole import at the same time).

    The collector is off while they import: torch's import makes millions of objects that are never garbage, and the
    collections they set off, each scanning all of them, were a fifth of a warm starter's imports here (0.6 s of 3 s:
    ``python -m benchmarks.first_run``). What exists then is frozen (never scanned again; a collection in a rank would
    copy its pages) and the collector is turned back on for the ranks."""
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    if not FORKS:
        return
    import gc

    collecting = gc.isenabled()
    gc.disable()
    try:
        _import(modules)
    finally:
        gc.freeze()  # torch's objects: never garbage, and a collection in a rank would copy their pages
        if collecting:
            gc.enable()


def _import(modules: Sequence[str]) -> None:
    """Import torch, then ``modules``; what fails is left for the rank that needs it to say, as a fresh one would."""
    try:
        import torch  # noqa: F401 - imported for its effect: once here, before the ranks fork
    except Exception:  # noqa: BLE001 - not installed, or broken (a CUDA library): each rank says so, as it would
        return
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the rank that needs it fails there, as a fresh one would
            pass


class ForkedRank:
    """What the starter needs of a rank it forked: :class:`subprocess.Popen`'s ``pid``, ``poll`` and
    ``send_signal`` (which, as Popen's, signals nothing once the rank is reaped: its pid may be another's)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def start(program: Sequence[str], env: Mapping[str, str]) -> "ForkedRank | subprocess.Popen":
    """Start ``python -u *program`` (a script and its arguments, or ``-m MODULE ARGS``) with ``env``: forked
    from this process where :data:`FORKS`, else a fresh interpreter."""
    # (A Python thread may hold a lock a fork would keep held; CUDA can't be forked, should an import have started it.)
    if not FORKS or threading.active_count() > 1 or _cuda_initialised():
        return subprocess.Popen(program_argv(program, flags=("-u",)), start_new_session=True,
                                stdin=subprocess.DEVNULL, env=dict(env))
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedRank(pid)
    try:
        _become_fresh(env)
        code = _run(list(program))
    except BaseException:  # noqa: BLE001 - nothing may return into the starter's code from here
        traceback.print_exc()
        code = 1
    os._exit(code & 0xFF)  # (as the C library's exit() keeps it)


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a broken CUDA library: not initialised here
        return False


def _become_fresh(env: Mapping[str, str]) -> None:
    """In the forked child: what ``Popen(start_new_session=True, stdin=DEVNULL, close_fds=True, env=env)``
    and a fresh interpreter's start would have given it."""
    die_with_parent()  # first: should the starter die from here on, so does this rank (the starter set the variable)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.environ.clear()
    os.environ.update(env)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for sig in signal.valid_signals():  # a handler the starter's code installed is not the program's: an exec
        if callable(signal.getsignal(sig)):  # resets it; what was ignored stays ignored, as across an exec
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, mode, closefd=False)  # ``-u``: writes go straight to the descriptor
        stream = io.TextIOWrapper(raw if mode == "w" else io.BufferedReader(raw), encoding=old.encoding,
                                  errors=old.errors, write_through=mode == "w")
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a fresh interpreter's global generator is seeded from the OS, each its own


def _run(program: list[str]) -> int:
    """Run the program in ``__main__`` as the interpreter would, and exit as it would: the exit code."""
    try:
        _run_main(program)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop)
    except BaseException as error:  # noqa: BLE001 - the interpreter reports any exception and exits with 1
        frames = _from_the_program(error.__traceback__)
        sys.excepthook(type(error), error.with_traceback(frames), frames)  # (the hook prints the error's own)
        if isinstance(error, KeyboardInterrupt):
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # killed by SIGINT: how CPython ends on an uncaught Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)
        code = 1
    _finish()
    return code


def _run_main(program: list[str]) -> None:
    if program[0] == "-m":
        import runpy

        sys.argv = ["-m", *program[2:]]  # (no folder first on the path: nbddp starts a module as module_argv does)
        runpy._run_module_as_main(program[1], alter_argv=True)  # type: ignore[attr-defined] - what ``-m`` calls
        return
    from importlib.machinery import SourceFileLoader

    script = program[0]
    sys.argv = list(program)
    if not has_safe_path():  # (a script's own folder first, as program_argv's interpreter has it: a private run dir)
        sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=os.path.abspath(script), __cached__=None, __builtins__=builtins,
                         __loader__=SourceFileLoader("__main__", script))
    sys.modules["__main__"] = main
    with io.open_code(script) as source:
        code = compile(source.read(), script, "exec", dont_inherit=True)  # (not this module's __future__ flags)
    exec(code, main.__dict__)  # noqa: S102 - the rank's program, run as the interpreter runs a script


def _from_the_program(frames: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without this module's frames: a fresh interpreter's starts at the program's."""
    while frames is not None and frames.tb_frame.f_code.co_filename == __file__:
        frames = frames.tb_next
    return frames


def _exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def _finish() -> None:
    """The interpreter's shutdown, as far as a program sees it: non-daemon threads joined, ``atexit`` run, the
    standard streams flushed (the collection of every object is skipped, as a rank's exit skips it anyway)."""
    threading._shutdown()  # type: ignore[attr-defined] - what the interpreter calls at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:  # what C code printed through stdio (an extension's printf): exit() flushes it, os._exit doesn't
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
