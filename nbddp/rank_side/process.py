"""A rank's plumbing, shared by both engines: log to files, report an exception, mark a finish,
leave the process group cleanly.

Launched by nbddp (``NBDDP_RUN_DIR`` set, see :mod:`nbddp.contracts.rank_env`) each rank writes its output to
``logs/rank-N.log``, its uncaught exception to ``errors/rank-N.json`` and a ``done`` mark when its
training finished: files, not pipes, so a flood of output can never block a rank and a dying
launcher can't take a rank's last words with it. :mod:`nbddp.rank_side.torch_engine` (the torch engine and the
user API) and :mod:`nbddp.rank_side.catalyst_engine` both build on this module; it imports neither.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import torch.distributed as dist

from nbddp.contracts.atomic import write_json
from nbddp.contracts.sourcemap import SourceMap
from nbddp.contracts.errors import NbddpError
from nbddp.rank_side import debugger, log_cap, memory, trackers
from nbddp.contracts.rank_env import RankEnv
from nbddp.rank_side.parent_death import die_with_parent
from nbddp.contracts.rundir import SCRIPT_NAME, RunDir

if TYPE_CHECKING:
    from datetime import timedelta


def use_notebook_folder() -> None:
    """A kernel imports modules from the notebook's folder; so do the ranks (their cwd is that folder)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(1, cwd)


def run_dir() -> RunDir | None:
    """The run dir nbddp launched this rank for (``None`` without a launcher)."""
    return RankEnv.from_environ().run_dir


def become_rank(global_rank: int, size: int) -> None:
    """Per-rank plumbing shared by both engines: die with the parent, log to files, leave the group safely."""
    die_with_parent(always=True)  # (an nbddp launcher's rank armed it before importing torch)
    guard_destroy()
    debugger.install()
    if not log_to_run_dir(global_rank):
        trackers.guard(global_rank)
        print(f"[nbddp] rank {global_rank}/{size} started (pid {os.getpid()})", flush=True)
        map_tracebacks_to_the_notebook()
        return
    previous_hook = sys.excepthook

    def record(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        record_exception(global_rank, exc_type, exc, tb)
        debugger.on_failure(global_rank, exc, tb)  # (--debug-on-failure: a post-mortem before the rank ends)
        previous_hook(exc_type, exc, tb)

    sys.excepthook = record
    announce(global_rank, size)


def log_to_run_dir(global_rank: int) -> bool:
    """Send this process's stdout and stderr (the file descriptors: C code too) to ``logs/rank-N.log``, kept
    within ``--log-cap`` (:mod:`nbddp.rank_side.log_cap`).

    ``False`` without a run dir (``python train.py``), where output stays where it was.
    """
    directory = run_dir()
    if directory is None:
        return False
    directory.logs.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory.rank_log(global_rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)  # (the umask applies)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    directory.ranks.mkdir(exist_ok=True)
    log_cap.watch(RankEnv.from_environ().log_cap, directory.rank_log_cap(global_rank))
    return True


def announce(global_rank: int, size: int, note: str = "") -> None:
    """``ranks/rank-N.json`` (pid, host, world size, attempt) and the "started" line: the rank is running."""
    trackers.guard(global_rank)  # (a warm rank's every job: its environment is the job's)
    directory = run_dir()
    directory.ranks.mkdir(exist_ok=True)
    write_json(directory.rank_info(global_rank),
               {"pid": os.getpid(), "host": socket.gethostname(), "world_size": size, "attempt": restart_count()})
    memory.watch(directory.rank_memory(global_rank), global_rank, fresh=True)
    print(f"[nbddp] rank {global_rank}/{size} started (pid {os.getpid()}){note}", flush=True)


def mark_done(global_rank: int) -> None:
    """Tell the launcher this rank finished its training normally (see :mod:`nbddp.job.lifecycle`)."""
    directory = run_dir()
    if directory is not None:
        memory.report()
        memory.watch(None)  # the final figure is written: no more calls into torch while the rank exits
        directory.ranks.mkdir(exist_ok=True)
        directory.rank_done(global_rank).touch()


def skip_final_collection() -> None:
    """Spare a rank that is about to exit the garbage collection of interpreter shutdown.

    With torch imported, that collection walks every object torch made and takes ~0.3 s (of a
    0.4 s exit), on the path between the last training step and the weights in the kernel
    (nbddp waits for every rank's exit status). ``gc.freeze()`` moves what exists now out of the
    collector's reach; shutdown still runs ``atexit`` handlers (logging's flush among them), flushes
    the standard streams and frees whatever reference counting frees. What only a collection would
    free, objects in a reference cycle, is not finalized: a file the training code left open inside
    one is not flushed (as in any process that exits with ``os._exit``). A warm rank runs more jobs:
    it never freezes.
    """
    if not warm():
        import gc

        gc.freeze()


def map_tracebacks_to_the_notebook() -> None:
    """Outside nbddp (the exported script under a person's own torchrun or Slurm), the traceback a rank prints
    names the notebook's cell and line beside each frame of the script (``line 49 [nb.ipynb, cell 3, line 2]``),
    read from the source map beside it (``train.py.map.json``). Under nbddp the job translates them itself;
    without the map (moved away, a script not nbddp's) tracebacks are Python's own."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    source_map = SourceMap.beside(script)
    if source_map is None or sys.excepthook is not sys.__excepthook__:
        return  # (a hook of the user's or a library's: theirs to print)

    def mapped(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(source_map.translate_traceback(text))
        sys.stderr.flush()

    sys.excepthook = mapped


def refuse(global_rank: int, error: NbddpError) -> NoReturn:
    """End this rank at once because of ``error``, a setup it can't train with (no GPU of its own): one
    line saying what happened and what to run instead, not a traceback from deep in torch; recorded as
    any rank's exception (``errors/rank-N.json``), and the rank exits with the error's code (3 for devices)."""
    record_exception(global_rank, type(error), error, error.__traceback__)
    print(f"nbddp: error: {error}", file=sys.stderr, flush=True)
    sys.exit(error.exit_code)


def record_exception(global_rank: int, exc_type: type[BaseException] | None, exc: BaseException | None,
                     tb: TracebackType | None, report: traceback.TracebackException | None = None) -> None:
    """Write ``errors/rank-N.json``: what the launcher shows, translated to the notebook. ``report``: the
    traceback as it should read, when it isn't ``tb``'s own (a warm rank's kept cells, moved to this job's lines)."""
    directory = run_dir()
    if directory is None or exc_type in (KeyboardInterrupt, SystemExit):
        return
    memory.report()
    directory.errors.mkdir(parents=True, exist_ok=True)
    frames = [
        {"file": f.filename, "line": f.lineno, "function": f.name, "text": f.line or ""}
        for f in (report.stack if report is not None else traceback.extract_tb(tb))
    ]
    report = {
        "rank": global_rank,
        "attempt": restart_count(),
        "time": time.time(),
        "type": exc_type.__name__,
        "message": str(exc),
        "frames": frames,
        "traceback": "".join(report.format() if report is not None else traceback.format_exception(exc_type, exc, tb)),
    }
    write_json(directory.rank_error(global_rank), report)


def exchange_roster(node_rank: int, nnodes: int, global_rank: int, node_ranks: range) -> list[dict[str, Any]]:
    """Across nodes: tell the others who this node is and learn who they are, through the group's store.

    The first rank of each node publishes its host, ranks, run dir and a digest of the training
    script; every rank reads all of them (a few store reads, once), and the first rank of each node
    writes the roster to ``nodes.json`` (node 0's ``result.json`` lists it; a node that went away is
    named from it). Nodes started with different notebooks or ``-p`` values would train different
    code in lockstep: every rank refuses that here, before the first step.
    """
    store = dist.distributed_c10d._get_default_store()
    first = global_rank == node_ranks.start
    if first:
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        digest = _code_digest(Path(main)) if main and Path(main).exists() else ""
        directory = run_dir()
        me = {"node": node_rank, "host": socket.gethostname(), "ip": _address(),
              "ranks": [node_ranks.start, node_ranks.stop - 1], "run_dir": str(directory) if directory else None,
              "script": digest, "setup": f"{len(node_ranks)} {RankEnv.from_environ().device or 'auto'}"}
        store.set(f"nbddp/node/{node_rank}", json.dumps(me))
    roster = [json.loads(store.get(f"nbddp/node/{n}")) for n in range(nnodes)]
    directory = run_dir()
    if first and directory is not None:
        write_json(directory.nodes, roster, indent=1)
    mine = roster[node_rank]
    for other in roster:
        if other["script"] != mine["script"]:
            raise NbddpError(
                f"node {other['node']} ({other['host']}) runs a different training script than node {node_rank}: "
                "start every node with the same notebook and the same -p values.")
        if other["setup"] != mine["setup"]:
            raise NbddpError(
                f"node {other['node']} ({other['host']}) runs {other['setup']} processes, node {node_rank} "
                f"{mine['setup']}: start every node with the same --gpus, or --cpu and --nproc.")
    return roster


def _code_digest(script: Path) -> str:
    """A digest of what the script does: comment lines (its header names paths that differ between
    machines) don't count."""
    import hashlib

    code = [line for line in script.read_text(encoding="utf-8").splitlines() if not line.lstrip().startswith("#")]
    return hashlib.sha256("\n".join(code).encode()).hexdigest()[:16]


def _address() -> str:
    """This host's address as other hosts see it (best effort; names the node a peer error points at)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""


def collective_timeout() -> timedelta | None:
    """``--collective-timeout`` (set by the launcher): how long a rank waits for its peers in a
    collective before raising, instead of torch's 30 minutes for gloo."""
    from datetime import timedelta

    seconds = RankEnv.from_environ().collective_timeout
    return timedelta(seconds=seconds) if seconds else None


def leave_group() -> None:
    """Wait for every rank, then leave the process group so that the rank can exit cleanly.

    Why not a plain ``barrier()`` + ``destroy_process_group()``: gloo runs collectives on worker
    threads, and a barrier keeps weak references to the collectives still in flight, typically
    DDP's last gradient all-reduce. That all-reduce captured torch's thread-local state during
    ``backward()``, which holds a Python object (autograd's ``contextvars`` context). The worker
    thread frees the barrier, and with it that object, *after* the main thread has seen the
    barrier complete; when the main thread has meanwhile reached interpreter shutdown, the
    worker's attempt to take the GIL makes CPython end the thread with ``pthread_exit``, whose
    unwinding through a ``noexcept`` destructor calls ``std::terminate``: "terminate called
    without an active exception", SIGABRT, a finished rank reported dead. Busy CPUs widen the
    window (1 run in ~10 with two runs and a CPU hog on two cores).

    So the barrier's work object is kept alive for the life of the process: the gloo thread
    never drops the last reference, nothing Python-owned is freed off the main thread, and the
    process ends through normal interpreter shutdown with exit status 0. Works the barrier
    did not capture were completely released before it started (gloo releases a finished work
    under the same lock the barrier takes to snapshot the in-flight ones).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    _final_barrier()
    if not warm():  # a warm rank keeps its group for the next job (see nbddp.rank_side.warm.loop)
        _TORCH_DESTROY()


def warm() -> bool:
    """True in a warm rank, which runs job after job in one process group."""
    return RankEnv.from_environ().warm


#: torch's own ``destroy_process_group``, before :func:`guard_destroy` wraps it.
_TORCH_DESTROY = dist.destroy_process_group


#: A warm rank's final barriers, kept until its group is released (:func:`release_group`): as
#: :func:`_keep_until_exit` does for a rank that exits, but freeable, since a released group
#: must be freed for its peers to notice.
_KEPT_WORKS: list[Any] = []


def _final_barrier() -> None:
    work = dist.barrier(async_op=True)
    work.wait()
    if warm():
        _KEPT_WORKS.append(work)
    else:
        _keep_until_exit(work)


def release_group() -> None:
    """A warm rank's job failed or was interrupted: free its process group, so that no peer stays
    blocked in a collective with it.

    Peers waiting in a collective for this rank only learn that it left when its sockets close
    (gloo's ``abort()`` and ``shutdown()`` don't wake them): the group must be *freed*, and with it
    everything of the job that held it (DDP's reducer, the barrier works kept above), which a
    collection frees once the job's namespace and traceback are gone. Each peer's collective then
    fails at once ("Connection closed by peer") and its job ends too; every rank then joins a new
    group (:func:`nbddp.rank_side.torch_engine.join_group`). NCCL communicators are aborted first.
    """
    import gc

    _KEPT_WORKS.clear()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            _TORCH_DESTROY()
    gc.collect()


def guard_destroy() -> None:
    """Make the training code's own ``dist.destroy_process_group()`` leave the group the same safe way.

    Scripts ported to a notebook often end with ``dist.barrier(); dist.destroy_process_group()``;
    that barrier has the same teardown race as any (see :func:`leave_group`). Destroying the default
    group therefore first runs a final barrier whose work is kept until exit. Every rank meets a
    barrier in any case: those that don't destroy the group themselves meet :func:`leave_group`'s.
    """
    import torch.distributed.distributed_c10d as c10d

    if getattr(dist.destroy_process_group, "_nbddp_guarded", False):
        return

    def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:  # (torch's signature)
        if dist.is_initialized() and (group is None or group is c10d.GroupMember.WORLD):
            _final_barrier()
            if warm():
                return None  # the warm rank's group outlives the job
        return _TORCH_DESTROY(group)

    destroy_process_group.__doc__ = _TORCH_DESTROY.__doc__
    destroy_process_group._nbddp_guarded = True  # type: ignore[attr-defined]
    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group


def _keep_until_exit(obj: Any) -> None:
    """A reference that even interpreter shutdown (which clears module globals) never drops."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def checkpoint_path() -> Path:
    """``$NBDDP_CHECKPOINT``, else ``weights.pt`` in the run dir, else beside the script."""
    env = RankEnv.from_environ()
    if env.checkpoint is not None:
        return env.checkpoint
    if env.run_dir is not None:
        return env.run_dir.weights
    main = getattr(sys.modules.get("__main__"), "__file__", None) or SCRIPT_NAME
    return Path(main).with_suffix(".weights.pt")


def restart_count() -> int:
    """Which attempt of the run this is, 0 the first: torchrun's restarts (``--max-restarts``) plus
    Slurm's requeues (``--requeue``; a run has one or the other)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0) + (RankEnv.from_environ().requeues or 0)
