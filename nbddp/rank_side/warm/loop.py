"""A warm rank: started once (as torchrun starts a rank), it joins the process group and then runs job after job.

What a fresh rank pays on every run (interpreter start, ``import torch``, device and gloo/NCCL
initialisation, the rendezvous) is paid here once; each job still means what a fresh rank's run
means: its script runs as ``__main__`` with the run's own ``NBDDP_*`` environment, its output in the
run's ``logs/rank-N.log``, its exception in ``errors/rank-N.json`` (its traceback starting at the
script, as a fresh rank's does). The setup cells the last job ran are kept
(:mod:`nbddp.rank_side.warm.state`): the job runs only those that changed and the ones after them,
and starts its training from the state right after setup, which the rank puts back after every job
while it waits for the next. The ranks agree on where the setup starts (``plans/N-R.json``). Modules
the training imported from the notebook's folder are forgotten after the job (the kept cells' stay
imported until their files change), and the CUDA caching allocator is emptied between jobs.
``forget`` (``%ddp_ranks forget``) drops the kept setup of an idle rank.

The kernel side (:mod:`nbddp.launchers.warm.pool`) hands out jobs through the pool's folder
(:class:`~nbddp.contracts.pool_dir.PoolDir`): ``jobs/N.json``; each rank answers ``ended/N-RANK.json``.
A rank with no job for its idle limit leaves the group and exits; so does every rank when the
kernel dies (parent-death signal, through the pool's starter).

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
(:mod:`nbddp.launchers.warm.departure`).

A job that failed (or that an interrupt stopped in the script) leaves its failure kept until the next job: its
traceback, whose frames hold the namespace as it failed, for ``%ddp_debug``, whose post-mortem is a job of its own
(``{"kind": "debug"}``: one rank runs pdb on it, relayed by the kernel; :mod:`nbddp.rank_side.debugger`). So the
setup's objects are put back at the start of the next job instead of at once, and since those frames keep the
process group from being freed, the rank shuts down its connections to its peers, which wakes them as freeing
would have.

``python -m nbddp.launchers.warm.agent POOL --nproc N --report R -- -m nbddp.rank_side.warm.loop POOL`` starts
the pool's ranks (:class:`nbddp.launchers.warm.pool.WarmPool`); under ``torchrun … -m nbddp.rank_side.warm.loop
POOL`` each would be the same rank.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from types import FrameType, TracebackType
from typing import Callable

from nbddp.rank_side.parent_death import die_with_parent

die_with_parent()  # dies with the pool's starter, armed before torch is imported (seconds)

# The rest only once that signal is armed (torch's import takes seconds): below the code, E402 deliberately broken.
import torch.distributed as dist  # noqa: E402 - after the arming

from nbddp.contracts.atomic import write_json  # noqa: E402 - after the arming
from nbddp.contracts.pool_dir import JobEnd, PoolDir  # noqa: E402 - after the arming
from nbddp.rank_side import debugger, memory, trackers  # noqa: E402 - after the arming
from nbddp.contracts.rank_env import DEFAULT_WARM_IDLE, RankEnv  # noqa: E402 - after the arming
from nbddp.rank_side.warm.process_state import ProcessState  # noqa: E402 - after the arming
from nbddp.rank_side.warm.state import Plan, WarmState  # noqa: E402 - after the arming

POLL_SECONDS = 0.005
#: An idle rank looks for its next job every POLL_SECONDS at first (a re-run right after a run starts at once),
#: then less and less often, down to every IDLE_POLL_SECONDS: an idle pool's ranks took 3% of a core each.
IDLE_POLL_SECONDS = 0.05


def main(folder: Path) -> int:
    from nbddp.rank_side import process as rank_process
    from nbddp.rank_side import torch_engine as runtime

    pool = PoolDir(folder)
    # Imported before any group exists: its functions' defaults are `group=group.WORLD`, evaluated at import,
    # and would otherwise hold the first group forever (so that freeing it could never wake a peer).
    import torch.distributed.nn.functional  # noqa: F401 - imported for that effect alone
    runtime.start()  # joins the group; no run dir yet: output goes to the pool's log
    # What exists now (torch, the first group) lives as long as the rank: the collections after each job skip
    # it. (Frozen objects are still freed when their last reference goes: a released group is.)
    gc.freeze()
    rank, size = runtime.rank(), runtime.world_size()
    store = dist_store()  # the group's store: a rebuilt group gets a prefix of its own in it
    idle = RankEnv.from_environ().warm_idle or DEFAULT_WARM_IDLE
    signal.signal(signal.SIGINT, _interrupt_the_job)
    _dump_stacks_when_asked(pool, rank)
    debugger.install()
    debugger.relocate = _relocated  # (kept cells' frames named by this job's script lines)
    pool.ready_dir.mkdir(exist_ok=True)
    write_json(pool.ready(rank), os.getpid())
    global _state
    _state = state = WarmState(Path.cwd())
    number = runs = 0  # (jobs handed out, and runs among them: a post-mortem is no run)
    pool_stdout, pool_stderr = os.dup(1), os.dup(2)
    while True:
        job = _next_job(pool, number, idle, state, rank)
        if job is None:
            break
        if job.get("kind") == "debug":  # %ddp_debug: a post-mortem of the failure kept, nothing else touched
            status = _post_mortem(job, pool, rank, number)
            write_json(pool.job_exit(number, rank), {"status": status.value})
            _write_kept(state, pool, rank, number)  # (%ddp_ranks reads it as the last job's)
            number += 1
            continue
        runs += 1
        if _failure is not None:  # the last job failed here: its frames go, its setup's objects are put back
            _let_failure_go(pool, rank)
            _keep_setup(state, pool, rank, number - 1)
            gc.collect()
            _release_device_memory()
        try:
            status = _run(job, pool, rank, size, number, state, runs)
        except KeyboardInterrupt:  # an interrupt a moment after the job ended (see _interrupt_the_job)
            status = JobEnd.INTERRUPTED
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(pool_stdout, 1)
        os.dup2(pool_stderr, 2)
        write_json(pool.job_exit(number, rank), {"status": status.value})
        if status != JobEnd.OK:  # (said first: should freeing the group block, the kernel still ends the job)
            if _failure is not None:  # its kept frames hold the group: its peers' connections are cut instead
                _cut_peer_connections(pool, rank)
            rank_process.release_group()  # wakes the peers still in a collective with this rank
            pool.mark(pool.released(number, rank))
        if _failure is None:
            _keep_setup(state, pool, rank, number)  # the setup's objects back as after setup, while the rank waits
        else:  # kept as the failure left them, for a post-mortem, until the next job
            _write_kept(state, pool, rank, number)
        gc.collect()  # the job's garbage, once the kernel knows the job ended
        _release_device_memory()
        if not _every_rank_ended_well(pool, number, size):
            rank_process.release_group()
            runtime.join_group(dist.PrefixStore(f"nbddp/warm/after_job_{number}", store), rank, size)
        number += 1
    rank_process.leave_group()
    return 0


def dist_store() -> dist.Store:
    """The store of this rank's default group (a FileStore in the pool's private folder)."""
    return dist.distributed_c10d._get_default_store()


#: The job this rank is in (its pool, number and this rank), while it is: only then does SIGINT
#: interrupt (the kernel's way to stop a job and keep its ranks); between jobs, an interrupt that came
#: late is ignored, and one that came early is the job's ``stopped`` mark, read as the job is taken.
_in_job: tuple[PoolDir, int, int] | None = None
#: Where SIGUSR1 writes this rank's stacks (kept open: :mod:`faulthandler` writes to its descriptor).
_stacks = None
#: What this rank keeps of the setup between jobs (kept cells' frames are moved to this job's script lines).
_state: WarmState | None = None


def _interrupt_the_job(signum: int, frame: FrameType | None) -> None:
    job = _in_job
    if job is not None:
        _heard(*job, frame)
        raise KeyboardInterrupt


def _heard(pool: PoolDir, number: int, rank: int, frame: FrameType | None) -> None:
    """Tell the kernel this rank heard the interrupt, and where: it is in Python (not stuck in C code),
    on its way out of the job. Best effort: a full disk must not turn an interrupt into another error."""
    frames = [[*_relocated(f.filename, f.lineno), f.name]
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
    interrupted by the kernel, or the kernel stops the pool (:class:`nbddp.launchers.warm.run.WarmRun`).
    """
    statuses: list[str | None] = [None] * size
    while None in statuses:
        for other in range(size):
            if statuses[other] is None:
                try:
                    statuses[other] = json.loads(pool.job_exit(number, other).read_text())["status"]
                except (OSError, ValueError, KeyError):
                    pass
        if None in statuses:
            time.sleep(POLL_SECONDS)
    return all(status == JobEnd.OK for status in statuses)


def _next_job(pool: PoolDir, number: int, idle: float, state: WarmState, rank: int) -> dict | None:
    """The next job's description, or ``None`` once idle for ``idle`` seconds (the kernel stops a pool
    by stopping its processes). Meanwhile, a request to forget the kept setup is answered."""
    global _forgotten
    path, deadline = pool.job(number), time.monotonic() + idle
    poll = POLL_SECONDS
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):  # not there yet (written atomically)
            asked = _forget_requests(pool)
            if asked > _forgotten:
                if _failure is not None:
                    _let_failure_go(pool, rank)
                state.forget()
                _release_device_memory()
                write_json(pool.kept(rank), {**state.report(), "job": number - 1})
                pool.mark(pool.forgot(asked, rank))
                _forgotten = asked
            time.sleep(poll)
            poll = min(poll * 1.02, IDLE_POLL_SECONDS)  # 5 ms to 50 ms in about 2 s
    return None


#: How many requests to forget the kept setup this rank answered.
_forgotten = 0


def _forget_requests(pool: PoolDir) -> int:
    try:
        return int(pool.forget_request.read_text())
    except (OSError, ValueError):
        return 0


def _run(job: dict, pool: PoolDir, rank: int, size: int, number: int, state: WarmState, run: int = 1) -> JobEnd:
    """Run one job's script as a fresh rank would (its setup cells kept from the last job where they didn't
    change): ``ok``, ``failed`` or ``interrupted``. A job stopped before this rank took it ends
    ``interrupted`` without running. ``run``: which run of this rank's it is (1 the first)."""
    global _in_job, _script
    from nbddp.rank_side import process as rank_process

    saved = ProcessState.capture()  # (the whole environment: the job's own variables go with the job)
    os.environ.update(job["env"])
    before, argv, main = set(sys.modules), list(sys.argv), sys.modules["__main__"]
    _fresh_random_state()
    status = JobEnd.OK
    _script = os.path.abspath(job["script"])
    try:
        try:
            # In this order: the kernel marks a job stopped *before* it sends SIGINT, and reads which ranks
            # took it after; so an interrupt is either seen here or raised by the handler, never lost.
            _in_job = (pool, number, rank)
            pool.mark(pool.taken(number, rank))
            if pool.stopped(number).exists():
                raise KeyboardInterrupt
            rank_process.log_to_run_dir(rank)
            rank_process.announce(rank, size, note=f" on a warm rank (its run {run})" if run > 1 else "")
            state.run(Path(job["script"]), _agree(pool, number, rank, size),
                      lambda line: print(f"[nbddp] {line}", flush=True) if rank == 0 else None)
        # Each handler first leaves the job: an interrupt landing while it reports the job's end (the kernel stops
        # every rank once one failed) must not cut the report, nor the failure kept, short.
        except SystemExit as exc:
            _in_job = None
            status = JobEnd.OK if exc.code in (None, 0) else JobEnd.FAILED
        except KeyboardInterrupt as exc:
            _in_job = None
            status = JobEnd.INTERRUPTED  # the kernel stopped the job (Ctrl-C, a time limit, a failed peer)
            if pool.heard(number, rank).exists():  # (interrupted in the job, not before it: where it was is kept)
                _keep_failure(pool, rank, number, job, exc, _without_handler(from_script(exc.__traceback__,
                                                                                         job["script"])))
            del exc
        except BaseException as exc:  # noqa: BLE001 - reported like an uncaught exception, then the next job
            _in_job = None
            tb = from_script(exc.__traceback__, job["script"])
            report = _relocate(traceback.TracebackException(type(exc), exc, tb))
            rank_process.record_exception(rank, type(exc), exc, tb, report=report)
            print("".join(report.format()), end="", file=sys.stderr)
            status = JobEnd.FAILED
            _keep_failure(pool, rank, number, job, exc, tb)
            del tb, report, exc
        finally:
            _in_job = None
    finally:
        trackers.end_job(status == JobEnd.FAILED, status == JobEnd.INTERRUPTED)  # (its lines: the job's log)
        debugger.end_job()  # (no tracing, breakpoint or open session of this job's in the next)
        memory.watch(None)  # the next job counts its own peak, in its own run dir
        signal.signal(signal.SIGINT, _interrupt_the_job)  # the job may have installed its own handler
        sys.modules["__main__"] = main
        sys.argv[:] = argv
        saved.restore()
        _forget_local_modules(before, Path(job["cwd"]), state.local_modules())
    return status


#: The script of the job this rank runs (kept cells' tracebacks are moved to its lines).
_script = ""


def _agree(pool: PoolDir, number: int, rank: int, size: int) -> Callable[[Plan], Plan]:
    """How the ranks agree on where job ``number``'s setup starts: each says where it would, all take the
    earliest (a setup's collectives must match), with the reason of the rank that needs it."""
    def agree(plan: Plan) -> Plan:
        write_json(pool.plan(number, rank), vars(plan))
        plans: list[dict | None] = [None] * size
        while None in plans:
            for other in range(size):
                if plans[other] is None:
                    try:
                        plans[other] = json.loads(pool.plan(number, other).read_text())
                    except (OSError, ValueError):
                        pass
            if None in plans:
                time.sleep(POLL_SECONDS)
        earliest = min(range(size), key=lambda r: plans[r]["start"])
        return plan if plans[earliest]["start"] == plan.start else Plan(**plans[earliest])
    return agree


#: The failure of this rank's last job, kept for a post-mortem (``%ddp_debug``) until the next job: its traceback
#: (whose frames hold the job's namespace as it failed), the script it ran, and the exception's line.
_failure: tuple[TracebackType, str, str] | None = None


def _keep_failure(pool: PoolDir, rank: int, number: int, job: dict, exc: BaseException,
                  tb: TracebackType | None) -> None:
    """Keep the failure's frames (an exception's, or where an interrupt found the rank: a peer had failed), and say
    so (``failures/rank-R.json``: the kernel picks the rank that failed first)."""
    global _failure
    import bdb

    if tb is None or isinstance(exc, bdb.BdbQuit) or not _in_script(tb, job["script"]):
        return  # (`q` in a debugger; an interrupt that came before the script ran: nothing of the job's to see)
    _failure = (tb, job["script"], f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    try:
        write_json(pool.failure(rank), {"job": number, "time": time.time(), "type": type(exc).__name__,
                                        "message": str(exc)[:300] or "stopped there (a peer failed, or the run was "
                                        "stopped)", "run_dir": str(RankEnv.from_environ(job["env"]).run_dir or "")})
    except OSError:
        pass


def _in_script(tb: TracebackType, script: str) -> bool:
    return os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(script)


def _without_handler(tb: TracebackType | None) -> TracebackType | None:
    """An interrupt's traceback without its last frame, :func:`_interrupt_the_job`'s (nbddp's, not the job's): a
    post-mortem opens where the rank was."""
    first = tb
    while tb is not None and tb.tb_next is not None:
        if tb.tb_next.tb_frame.f_code is _interrupt_the_job.__code__:
            tb.tb_next = None
        else:
            tb = tb.tb_next
    return first


def _let_failure_go(pool: PoolDir, rank: int) -> None:
    global _failure
    _failure = None
    pool.failure(rank).unlink(missing_ok=True)


def _post_mortem(job: dict, pool: PoolDir, rank: int, number: int) -> JobEnd:
    """Job ``number`` is a post-mortem (``{"kind": "debug", "rank": R}``): rank R opens its debugger on the failure
    it keeps (the frame it failed in, the namespace as it was), relayed by the kernel; the other ranks end the job
    at once. Their group and the kept setup are left as they are; what the session changed in the process (its
    environment, its folder, ``sys.path``) is put back, as after any job."""
    global _in_job, _script
    from nbddp.rank_side.debugger import new_channel, notebook_lines, post_mortem

    pool.mark(pool.taken(number, rank))
    if job.get("rank") != rank or pool.stopped(number).exists():
        return JobEnd.OK
    folder = pool.debug_sessions(number)
    if _failure is None:
        channel = new_channel(folder, rank)
        channel.open(rank, "post-mortem")
        channel.write(f"rank {rank} keeps no failure: its last job didn't fail here (or a later job ran)\n")
        channel.close()
        return JobEnd.OK
    tb, _script, headline = _failure
    saved = ProcessState.capture()
    _in_job = (pool, number, rank)  # (an interrupt ends the session)
    try:
        post_mortem(tb, folder, rank, "post-mortem", notebook_lines(_script), headline)
    except KeyboardInterrupt:
        return JobEnd.INTERRUPTED
    finally:
        _in_job = None
        del tb
        debugger.end_job()
        signal.signal(signal.SIGINT, _interrupt_the_job)
        saved.restore()
    return JobEnd.OK


def _cut_peer_connections(pool: PoolDir, rank: int) -> None:
    """Shut down this rank's connections to its peers (gloo's), which wake a peer waiting for it in a collective
    as freeing the group would; needed where the kept failure's frames keep the group from being freed.
    Best effort: a peer that can't be woken is left to the kernel's interrupt and its departure rules."""
    import socket

    import psutil

    def connections(process: psutil.Process) -> list:
        listing = getattr(process, "net_connections", None) or process.connections
        return listing(kind="tcp")

    try:
        peer_pids = [pid for other, pid in pool.rank_pids().items() if other != rank]
        peers = {tuple(c.laddr) for pid in peer_pids for c in connections(psutil.Process(pid)) if c.laddr}
        for own in connections(psutil.Process()):
            if own.raddr and tuple(own.raddr) in peers and own.fd >= 0:
                with socket.fromfd(own.fd, socket.AF_INET6 if ":" in own.laddr[0] else socket.AF_INET,
                                   socket.SOCK_STREAM) as copy:
                    copy.shutdown(socket.SHUT_RDWR)
    except (OSError, psutil.Error):
        pass


def _write_kept(state: WarmState, pool: PoolDir, rank: int, number: int) -> None:
    try:
        write_json(pool.kept(rank), {**state.report(), "job": number})
    except OSError:
        pass


def _keep_setup(state: WarmState, pool: PoolDir, rank: int, number: int) -> None:
    """After a job: the kept setup's objects back as they were after setup (what can't be, let go), and
    what the rank keeps written for ``%ddp_ranks``. Never costs the rank: a failure here keeps nothing."""
    try:
        state.after_job()
    except Exception as exc:  # noqa: BLE001 - it never costs the rank: a failure here keeps nothing
        print(f"[nbddp] setup: not kept: putting it back failed ({type(exc).__name__}: {exc})", flush=True)
        state.forget()
    _write_kept(state, pool, rank, number)


def _relocated(filename: str, line: int) -> tuple[str, int]:
    return _state.relocate(filename, line, _script) if _state is not None and _script else (filename, line)


def _relocate(report: traceback.TracebackException) -> traceback.TracebackException:
    """Move the frames of kept cells' code (compiled in an earlier job's script) to this job's script lines,
    in the exception and every exception chained to it."""
    pending, seen = [report], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for index, frame in enumerate(current.stack):
            filename, line = _relocated(frame.filename, frame.lineno)
            if (filename, line) != (frame.filename, frame.lineno):
                current.stack[index] = traceback.FrameSummary(filename, line, frame.name)
        pending.extend(e for e in (current.__cause__, current.__context__,
                                   *(getattr(current, "exceptions", None) or ()))
                       if e is not None)
    return report


def from_script(tb: TracebackType | None, script: str) -> TracebackType | None:
    """The traceback from the script's first frame on: this loop's and :mod:`~nbddp.rank_side.warm.state`'s
    frames are how a warm rank runs the script, not part of what it did (a fresh rank's traceback starts at
    the script too)."""
    first = tb
    while first is not None and os.path.abspath(first.tb_frame.f_code.co_filename) != os.path.abspath(script):
        first = first.tb_next
    return first or tb


def _fresh_random_state() -> None:
    """Seed torch's, Python's and (if imported) NumPy's generators from the OS, as a new process
    does: a job that doesn't seed gets a random state unrelated to the previous job's."""
    import random

    import torch

    torch.seed()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _forget_local_modules(before: set[str], folder: Path, kept: set[str]) -> None:
    """Drop modules the job imported from the notebook's folder, so the next job imports them afresh; those
    that kept setup cells imported (files in ``kept``) stay, as the cells' objects do."""
    folder = folder.resolve()
    for name in set(sys.modules) - before:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path and Path(path).resolve().is_relative_to(folder) and str(Path(path).resolve()) not in kept:
            del sys.modules[name]


def _release_device_memory() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()



if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
