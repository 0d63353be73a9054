"""``python -m nbddp.launchers.warm.agent POOL STARTER_ARGS…``: the ranks' starter for a warm pool, which
removes the pool's folder once nobody can need it.

nbddp's own starter runs here (:mod:`nbddp.launchers.direct_main`, as for a fresh run on one machine: no
torchrun agent to import torch and meet in a rendezvous first, 2 s). When it ends, the folder goes if its
ranks all left on their own (idle), if the pool's owner asked for the pool to stop for good, or if the
owner is gone: a kernel killed outright (a restart, SIGKILL) can't remove its pool's folder, and this
process outlives it by the moment the starter takes to stop the ranks (parent-death signal, see
:mod:`nbddp.rank_side.parent_death`). After a rank failed while its owner lives, the folder stays: the
owner reads the starter's report there to name the dead rank, then removes it.

``python -m nbddp.launchers.warm.agent POOL --preload IDLE NPROC`` starts it ahead of its first run (a kernel that
loaded the extension: :class:`nbddp.launchers.warm.preload.Preload`): it imports what its ranks will import
(:data:`PRELOADED`) and waits for the first run's word (``go.json``: the starter's options, the
ranks' environment and folder), then forks the ranks at once. Where that word asks for what the imports already
read otherwise (another folder, another environment, another ``OMP_NUM_THREADS``), the process starts again as
that run's plain starter (an ``exec``: the same pid, the same parent-death signal), as if nothing had been
preloaded. With no word for ``IDLE`` seconds it leaves, and the folder goes: what was preloaded is released.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from typing import Mapping

from nbddp.contracts.atomic import write_json
from nbddp.contracts.status import signal_exit_code
from nbddp.contracts.rank_env import PER_RUN_VARIABLES, threads_per_rank
from nbddp.launchers import direct_main, forked_rank
from nbddp.contracts.pool_dir import PoolDir
from nbddp.contracts.process_groups import process_alive
from nbddp.rank_side.parent_death import arm
from nbddp.contracts.interpreter import module_argv

PRELOAD = "--preload"
#: What a warm rank imports before its first job, besides torch: a DDP rank's imports, the warm loop's, and DDP's.
PRELOADED = (*forked_rank.RANK_IMPORTS, "nbddp.rank_side.warm.state", "nbddp.rank_side.debugger",
             "nbddp.rank_side.trackers", "nbddp.rank_side.memory", *forked_rank.DDP_IMPORTS)
#: How often a preloaded starter looks for its first run's word: often for its first seconds (a first run right after
#: the setup cells), then less (an idle starter woke 100 times a second).
GO_POLL_SECONDS, GO_POLL_FAST_FOR, IDLE_GO_POLL_SECONDS = 0.01, 10.0, 0.05
#: What an IPython kernel sets in its own environment as it starts, for its shell's subprocesses: a colour terminal,
#: no pager, matplotlib's inline backend (``TERM`` and pydevd's ``PYDEVD_`` are per-run variables already). The nbddp
#: kernel starts the starter before, and none of what it imports reads them (tests/test_preload.py).
KERNEL_START_VARIABLES = ("CLICOLOR", "FORCE_COLOR", "PAGER", "GIT_PAGER", "MPLBACKEND")
#: What torch's import doesn't read, so that a first run may differ in it from the preload: what makes no warm ranks
#: stale (nbddp's own variables among them), the GPUs a run chose (CUDA reads them as it starts, in a rank), and what
#: the kernel sets as it starts.
_NOT_READ_AT_IMPORT = (*PER_RUN_VARIABLES, "CUDA_VISIBLE_DEVICES", *KERNEL_START_VARIABLES)


def main(argv: list[str]) -> None:
    pool = PoolDir(argv[0])
    idle = False
    # Its owner's death, or stop, before the starter has its own handlers: the folder goes on the way out (the ranks
    # reset them, see forked_rank).
    for name in ("SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), _leave)
    try:
        starter = argv[1:]
        if starter[:1] == [PRELOAD]:
            starter = _preloaded(pool, float(starter[1]), int(starter[2]))
        # (None: no run came; 0: every rank returned, none having had a job for its idle limit)
        idle = starter is None or direct_main.main(starter) == 0
    finally:
        for _ in range(3):  # a signal landing before they are all ignored interrupts this, once
            try:
                _ignore_stop_signals()
                break
            except BaseException:  # noqa: BLE001 - torchrun's SignalException
                continue
        if idle or pool.stop_mark.exists() or _owner_gone(pool.owner()):
            shutil.rmtree(pool.path, ignore_errors=True)


def _preloaded(pool: PoolDir, idle: float, nproc: int) -> list[str] | None:
    """Import what the ranks will, then wait for the first run's word: its starter options (``None``: its owner is
    gone, stopped it, or no run claimed it within ``idle`` seconds). Where the run wants another folder or
    environment than the imports read (the kernel checks first: this is the backstop), this process is replaced by
    the run's plain starter."""
    arm(signal.SIGTERM)  # (started without parent_death's wrapper: see Preload)
    if os.getppid() != pool.owner():
        return None  # the owner died before the signal was armed
    before, started = dict(os.environ), time.monotonic()
    imported = as_imported(before, nproc)
    forked_rank.preload(imported["OMP_NUM_THREADS"], PRELOADED)  # (all of it, a run come meanwhile or not: each
    # rank would import the rest whole, on a core of its own)
    write_json(pool.preloaded, {"seconds": round(time.monotonic() - started, 3)})
    waiting_since = time.monotonic()
    while not pool.go.exists():
        waited = time.monotonic() - waiting_since
        if pool.stop_mark.exists() or (waited > idle and pool.claim("idle")):
            return None  # (a run that claimed it first writes its word next)
        time.sleep(GO_POLL_SECONDS if waited < GO_POLL_FAST_FOR else IDLE_GO_POLL_SECONDS)
    go = json.loads(pool.go.read_text(encoding="utf-8"))
    pool.go.unlink()  # (the kernel's environment, secrets included, stays on disk no longer than this)
    starter, env, cwd = list(go["argv"]), dict(go["env"]), go["cwd"]
    if cwd != os.getcwd() or as_imported(env, int(go["nproc"])) != imported:
        os.chdir(cwd)
        os.execve(sys.executable, module_argv("nbddp.launchers.warm.agent", str(pool.path), *starter), env)
    added = {name: value for name, value in os.environ.items() if before.get(name) != value}  # by the imports
    os.environ.clear()
    os.environ.update({**added, **env})
    return starter


def _leave(signum: int, frame: object) -> None:
    """Leave, once: a killed owner's dying threads can each send a parent-death signal (see
    :func:`_ignore_stop_signals`), and one landing as the folder is being removed would leave it half removed."""
    _ignore_stop_signals()
    raise SystemExit(signal_exit_code(signum))


def as_imported(environ: Mapping[str, str], nproc: int) -> dict[str, str]:
    """What of an environment the imports may have read, with the ``OMP_NUM_THREADS`` ``nproc`` ranks get: a starter
    started ahead serves a first run whose ranks' environment reads the same (the one rule, checked by the kernel,
    :meth:`nbddp.launchers.warm.preload.Preload.why_not`, and again here)."""
    seen = {name: value for name, value in environ.items() if not name.startswith(_NOT_READ_AT_IMPORT)}
    seen.setdefault("OMP_NUM_THREADS", threads_per_rank(nproc))
    return seen


def _ignore_stop_signals() -> None:
    """Let nothing interrupt the last cleanup: this process is ending anyway.

    A SIGKILLed owner can send more than one parent-death SIGTERM: Linux re-parents this process to
    another of the owner's threads while they die one by one, and each such parent's death signals
    again. Under torchrun's agent each became an exception, and one that landed inside ``rmtree`` left
    the folder half removed (seen in the full test tier, and reproduced on a loaded machine).
    """
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def _owner_gone(owner: int | None) -> bool:
    """The pool's owner (this process's parent) is dead, or dying.

    A killed owner's parent-death signal can bring this process here while the owner is still
    tearing its threads down, not yet a zombie: asking whether it is alive then says yes, and the
    folder would stay (seen once in the full test tier). Linux re-parents this process *before* it
    sends that signal, so a changed parent is the sure sign.
    """
    return owner is not None and (os.getppid() != owner or not process_alive(owner))


if __name__ == "__main__":
    main(sys.argv[1:])
