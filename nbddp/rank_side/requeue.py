"""Stop at the next checkpoint so that a Slurm job can requeue itself and resume.

A job submitted with requeueing on (``--requeue``, or by default when the training code calls
``nbddp.save_checkpoint``) gets a signal from Slurm before its time limit, and at preemption where
the cluster sends it (``SlurmctldParameters=preempt_send_user_signal``). The batch shell turns it into
``slurm/requeue-request`` (:mod:`nbddp.launchers.slurm`); this module makes every rank stop at the
same ``save_checkpoint`` call after it, once the save is complete, so the requeued job resumes
(``nbddp.restore``) exactly where this attempt stopped.

Why at a save and why all at the same one: a rank that stopped anywhere else would lose the work
since the last save, and one that stopped a step before its peers would leave them waiting in a
collective. Rank 0 decides for each save (``n``-th call) and publishes the decision in the
group's store; every rank reads it there, so all stop after the same save (the cost: one store
round trip per save). This needs ``save_checkpoint`` called on every rank, as a sharded model
already does.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from nbddp.contracts.atomic import write_json
from nbddp.contracts.rank_env import RankEnv

_saves = 0


def stop_here(attempt: int) -> bool:
    """At a save, before it is written, on every rank: whether every rank stops after it for a requeue.

    Rank 0 decides before writing, so the others wait for its decision, not for its write (they wait
    for the write in :func:`stop`'s barrier, and only when stopping).

    Raises:
        NbddpError: rank 0 never reached this save (it calls ``save_checkpoint`` fewer times, or only
            on some ranks), within the collective timeout.
    """
    global _saves
    env = RankEnv.from_environ()
    if not env.requeue or env.run_dir is None or not (dist.is_available() and dist.is_initialized()):
        return False
    _saves += 1
    store = dist.distributed_c10d._get_default_store()
    key = f"nbddp/requeue/{attempt}/{_saves}"
    if dist.get_rank() == 0:
        store.set(key, "1" if requested(attempt) else "0")
    else:
        _wait_for(store, key)
    return store.get(key) == b"1"


def _wait_for(store: Any, key: str) -> None:
    from nbddp.contracts.errors import NbddpError
    from nbddp.rank_side.process import collective_timeout

    timeout = collective_timeout() or timedelta(minutes=30)
    try:
        store.wait([key], timeout)
    except RuntimeError as exc:  # the store's own timeout (DistStoreError is one)
        raise NbddpError(
            f"nbddp.save_checkpoint: rank {dist.get_rank()} waited {timeout.total_seconds():g} s for rank 0 at save "
            f"#{_saves}: in a Slurm job that requeues itself every rank calls save_checkpoint, the same number of "
            "times (not only on rank 0, nor only when its own loss improved). Call it on every rank, or submit "
            f"with --no-requeue. ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def requested(attempt: int) -> bool:
    """Slurm signalled this attempt (the batch shell wrote the attempt's number)."""
    directory = RankEnv.from_environ().run_dir
    try:
        return directory is not None and directory.requeue_request.read_text().strip() == str(attempt)
    except OSError:
        return False


def stop(attempt: int, saved: dict[str, Any]) -> None:
    """Leave the group with every rank and exit 0: the batch shell then requeues the job.

    Rank 0 first writes ``slurm/requeue-saved`` (the attempt and the plain values saved, e.g. the
    epoch), which tells the batch shell and the watcher that this attempt stopped to be requeued,
    not that it failed or finished.
    """
    from nbddp.rank_side.process import leave_group

    plain = {k: v for k, v in saved.items() if isinstance(v, (int, float, str, bool))}
    if dist.get_rank() == 0:
        directory = RankEnv.from_environ().run_dir
        write_json(directory.requeue_saved, {"attempt": attempt, "saved": plain})
        at = ", ".join(f"{k}={v}" for k, v in plain.items())
        print(f"[nbddp] Slurm signalled the job (time limit near, or preemption): every rank saved at this "
              f"checkpoint{f' ({at})' if at else ''} and stops; the job is requeued and resumes from it", flush=True)
    leave_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not SystemExit: nothing of the training code may catch it and train on alone
