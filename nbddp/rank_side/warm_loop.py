"""A warm rank: started once by torchrun, it joins the process group and then runs job after job.

What a fresh rank pays on every run (interpreter start, ``import torch``, device and gloo/NCCL
initialisation, the rendezvous) is paid here once; each job still runs its script exactly as a
fresh rank would: ``runpy`` executes it as ``__main__`` in a **fresh namespace**, with the run's
own ``NBDDP_*`` environment, its output in the run's ``logs/rank-N.log``, its exception in
``errors/rank-N.json`` (its traceback starting at the script, as a fresh rank's does). Modules the
job imported from the notebook's folder are forgotten after it, so the next job imports them anew,
and the CUDA caching allocator is emptied between jobs.

The kernel side (:mod:`nbddp.launchers.warm_pool`) hands out jobs through the pool's folder
(:class:`~nbddp.rank_side.pool_dir.PoolDir`): ``jobs/N.json``; each rank answers ``ended/N-RANK.json``.
A rank with no job for its idle limit leaves the group and exits; so does every rank when the
kernel dies (parent-death signal, through torchrun).

A job that fails or is interrupted doesn't cost the ranks: the kernel marks the job stopped
(``stopped/N``) and interrupts every rank still in it (SIGINT, which raises ``KeyboardInterrupt`` in
the job only, and which the rank acknowledges with where it was: ``heard/N-R.json``); a rank that
takes the job after that ends it without running it (on a loaded machine the interrupt can come
before a rank took the job, which would otherwise run it to the end). A rank whose job didn't end
``ok`` frees its process group (:func:`nbddp.rank_side.process.release_group`), which wakes any
peer waiting for it in a collective, and once every rank has ended the job, all of them join a
new group before the next one. Only a rank that can't be brought back (killed, or stuck where no
interrupt reaches it) costs the pool, which the kernel then replaces at once; SIGUSR1 writes every
thread's Python stack to ``stacks/rank-R.txt`` (:mod:`faulthandler`, which runs whatever the main
thread is doing), so that the kernel can say where such a rank was
(:mod:`nbddp.launchers.warm_departure`).

``python -m torch.distributed.run … -m nbddp.rank_side.warm_loop POOL`` starts one.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path
from types import TracebackType

import torch.distributed as dist

from nbddp.atomic import write_json
from nbddp.rank_side.pool_dir import PoolDir
from nbddp.rank_side import memory
from nbddp.rank_side.env import DEFAULT_WARM_IDLE, RankEnv

POLL_SECONDS = 0.005


def main(folder: Path) -> int:
    from nbddp.rank_side import process as rank_process
    from nbddp.rank_side import torch_engine as runtime

    pool = PoolDir(folder)
    # Imported before any group exists: its functions' defaults are `group=group.WORLD`, evaluated at import,
    # and would otherwise hold the first group forever (so that freeing it could never wake a peer).
    import torch.distributed.nn.functional  # noqa: F401
    runtime.start()  # joins the group; no run dir yet: output goes to the pool's log
    # What exists now (torch, the first group) lives as long as the rank: the collections after each job skip
    # it. (Frozen objects are still freed when their last reference goes: a released group is.)
    gc.freeze()
    rank, size = runtime.rank(), runtime.world_size()
    store = dist_store()  # the group's store: a rebuilt group gets a prefix of its own in it
    idle = RankEnv.from_environ().warm_idle or DEFAULT_WARM_IDLE
    signal.signal(signal.SIGINT, _interrupt_the_job)
    _dump_stacks_when_asked(pool, rank)
    pool.ready_dir.mkdir(exist_ok=True)
    write_json(pool.ready(rank), os.getpid())
    number = 0
    pool_stdout, pool_stderr = os.dup(1), os.dup(2)
    while True:
        job = _next_job(pool, number, idle)
        if job is None:
            break
        try:
            status, modules = _run(job, pool, rank, size, number)
        except KeyboardInterrupt:  # an interrupt a moment after the job ended (see _interrupt_the_job)
            status, modules = "interrupted", {}
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(pool_stdout, 1)
        os.dup2(pool_stderr, 2)
        write_json(pool.ended(number, rank), {"status": status, "modules": modules})
        if status != "ok":  # (said first: should freeing the group block, the kernel still ends the job)
            rank_process.release_group()  # wakes the peers still in a collective with this rank
            pool.mark(pool.released(number, rank))
        gc.collect()  # the job's garbage, once the kernel knows the job ended
        _release_device_memory()
        if not _every_rank_ended_well(pool, number, size):
            rank_process.release_group()
            runtime.join_group(dist.PrefixStore(f"nbddp/warm/after_job_{number}", store), rank, size)
        number += 1
    rank_process.leave_group()
    return 0


def dist_store():
    """The store of this rank's default group (torchrun's, under this attempt's prefix)."""
    return dist.distributed_c10d._get_default_store()


#: The job this rank is in (its pool, number and this rank), while it is: only then does SIGINT
#: interrupt (the kernel's way to stop a job and keep its ranks); between jobs, an interrupt that came
#: late is ignored, and one that came early is the job's ``stopped`` mark, read as the job is taken.
_in_job: tuple[PoolDir, int, int] | None = None
#: Where SIGUSR1 writes this rank's stacks (kept open: :mod:`faulthandler` writes to its descriptor).
_stacks = None


def _interrupt_the_job(signum: int, frame) -> None:  # noqa: ANN001 - signal handler
    job = _in_job
    if job is not None:
        _heard(*job, frame)
        raise KeyboardInterrupt


def _heard(pool: PoolDir, number: int, rank: int, frame) -> None:  # noqa: ANN001 - a frame
    """Tell the kernel this rank heard the interrupt, and where: it is in Python (not stuck in C code),
    on its way out of the job. Best effort: a full disk must not turn an interrupt into another error."""
    frames = [[f.filename, f.lineno, f.name]
              for f in traceback.StackSummary.extract(traceback.walk_stack(frame), limit=60, lookup_lines=False)]
    try:
        pool.heard(number, rank).parent.mkdir(exist_ok=True)
        write_json(pool.heard(number, rank), {"frames": frames[::-1]})
    except OSError:
        pass


def _dump_stacks_when_asked(pool: PoolDir, rank: int) -> None:
    """SIGUSR1: every thread's Python stack into ``stacks/rank-R.txt``, after a line naming the main thread.

    :mod:`faulthandler`'s handler is C, so it answers while the main thread is blocked in C code (a
    collective that never returns), where no Python signal handler can run: that is how the kernel
    learns where a rank that couldn't leave a job was.
    """
    import faulthandler
    import threading

    global _stacks
    pool.stack(rank).parent.mkdir(exist_ok=True)
    _stacks = open(pool.stack(rank), "w", encoding="utf-8")  # noqa: SIM115 - open for the rank's life
    _stacks.write(f"main thread 0x{threading.main_thread().ident:016x}\n")
    _stacks.flush()
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)


def _every_rank_ended_well(pool: PoolDir, number: int, size: int) -> bool:
    """Wait until every rank has ended job ``number``; True if each ended it ``ok``.

    If one didn't, the group may be inconsistent (collectives that some ranks ran and others
    didn't), so every rank joins a new one before the next job. A rank that never ends the job is
    interrupted by the kernel, or the kernel stops the pool (:class:`nbddp.launchers.warm_pool.WarmRun`).
    """
    statuses: list[str | None] = [None] * size
    while None in statuses:
        for other in range(size):
            if statuses[other] is None:
                try:
                    statuses[other] = json.loads(pool.ended(number, other).read_text())["status"]
                except (OSError, ValueError, KeyError):
                    pass
        if None in statuses:
            time.sleep(POLL_SECONDS)
    return all(status == "ok" for status in statuses)


def _next_job(pool: PoolDir, number: int, idle: float) -> dict | None:
    """The next job's description, or ``None`` once idle for ``idle`` seconds (the kernel stops a pool
    by stopping its processes)."""
    path, deadline = pool.job(number), time.monotonic() + idle
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):  # not there yet (written atomically)
            time.sleep(POLL_SECONDS)
    return None


def _run(job: dict, pool: PoolDir, rank: int, size: int, number: int) -> tuple[str, dict[str, float]]:
    """Run one job's script as a fresh rank would: ``ok``, ``failed`` or ``interrupted``, and the local
    modules it imported. A job stopped before this rank took it ends ``interrupted`` without running."""
    global _in_job
    from nbddp.rank_side import process as rank_process

    saved = dict(os.environ)
    os.environ.update(job["env"])
    before, cwd, path = set(sys.modules), os.getcwd(), list(sys.path)
    torch_settings = _torch_settings()
    _fresh_random_state()
    status = "ok"
    try:
        try:
            # In this order: the kernel marks a job stopped *before* it sends SIGINT, and reads which ranks
            # took it after; so an interrupt is either seen here or raised by the handler, never lost.
            _in_job = (pool, number, rank)
            pool.mark(pool.taken(number, rank))
            if pool.stopped(number).exists():
                raise KeyboardInterrupt
            rank_process.log_to_run_dir(rank)
            rank_process.announce(rank, size, note=f" on a warm rank (its run {number + 1})" if number else "")
            runpy.run_path(job["script"], run_name="__main__")
        except SystemExit as exc:
            status = "ok" if exc.code in (None, 0) else "failed"
        except KeyboardInterrupt:
            status = "interrupted"  # the kernel stopped the job (Ctrl-C, a time limit, a failed peer)
        except BaseException as exc:  # noqa: BLE001 - reported like an uncaught exception, then the next job
            tb = from_script(exc.__traceback__, job["script"])
            rank_process.record_exception(rank, type(exc), exc, tb)
            traceback.print_exception(type(exc), exc, tb)
            status = "failed"
            del tb  # its frames hold the job's namespace, and through it the process group
        finally:
            _in_job = None
    finally:
        memory.watch(None)  # the next job counts its own peak, in its own run dir
        signal.signal(signal.SIGINT, _interrupt_the_job)  # the job may have installed its own handler
        os.environ.clear()
        os.environ.update(saved)
        os.chdir(cwd)
        sys.path[:] = path
        _restore_torch_settings(torch_settings)
        modules = _forget_local_modules(before, Path(job["cwd"]))
    return status, modules


def from_script(tb: TracebackType | None, script: str) -> TracebackType | None:
    """The traceback from the script's first frame on: this loop's and runpy's frames are how a warm rank
    runs the script, not part of what it did (a fresh rank's traceback starts at the script too)."""
    first = tb
    while first is not None and os.path.abspath(first.tb_frame.f_code.co_filename) != os.path.abspath(script):
        first = first.tb_next
    return first or tb


def _torch_settings() -> dict:
    """torch's process-wide settings a job may change (a fresh rank would start from the defaults)."""
    import torch

    return {"dtype": torch.get_default_dtype(), "threads": torch.get_num_threads(),
            "grad": torch.is_grad_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark, "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_tf32": torch.backends.cudnn.allow_tf32, "matmul_precision": torch.get_float32_matmul_precision()}


def _restore_torch_settings(settings: dict) -> None:
    import torch

    torch.set_default_dtype(settings["dtype"])
    torch.set_num_threads(settings["threads"])
    torch.set_grad_enabled(settings["grad"])
    torch.use_deterministic_algorithms(settings["deterministic"])
    torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = settings["cudnn_deterministic"]
    torch.backends.cudnn.allow_tf32 = settings["cudnn_tf32"]
    torch.set_float32_matmul_precision(settings["matmul_precision"])


def _fresh_random_state() -> None:
    """Seed torch's, Python's and (if imported) NumPy's generators from the OS, as a new process
    does: a job that doesn't seed gets a random state unrelated to the previous job's."""
    import random

    import torch

    torch.seed()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _forget_local_modules(before: set[str], folder: Path) -> dict[str, float]:
    """Drop modules the job imported from the notebook's folder, so the next job imports them afresh;
    return their files' modification times (the kernel starts fresh ranks when one is edited)."""
    folder, found = folder.resolve(), {}
    for name in set(sys.modules) - before:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path and Path(path).resolve().is_relative_to(folder):
            del sys.modules[name]
            try:
                found[str(Path(path).resolve())] = os.stat(path).st_mtime
            except OSError:
                pass
    return found


def _release_device_memory() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()



if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
