"""Concurrent trials (``nbddp tune --gpus-per-trial K``, or ``--parallel J``): one worker process per device slot,
each an ``nbddp tune`` with warm ranks of its own on its slot's GPUs, all sharing the study through its storage.

This is Optuna's own way to run trials at once (processes sharing an RDB storage); ``nbddp batch`` cuts the GPUs
into slots the same way (:func:`~nbddp.doors.batch.schedule.device_slots`), each slot's process pinned with
``CUDA_VISIBLE_DEVICES``. The workers take trials from a count kept in the study's folder (:class:`Tickets`), so the
study runs exactly ``--trials`` trials however fast each worker goes. A worker ends its trial's job and leaves as
soon as the process that started it is gone (SIGKILL included: it checks on every poll of the job), and the
parent passes a Ctrl-C or ``kill`` on to every worker, which stops its job as ``nbddp run`` does.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from nbddp.contracts.errors import SignalReceived, UsageError, stop_signal
from nbddp.contracts.interpreter import module_argv
from nbddp.contracts.process_groups import stop_groups
from nbddp.plan.options import LaunchOptions

#: How often the parent looks at its workers.
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class SlotRequest:
    """What :func:`~nbddp.doors.batch.schedule.device_slots` reads of a sweep, for a study's trials."""

    launch: LaunchOptions
    parallel: int | None
    per_run_gpus: int | None

    @property
    def per_run_flag(self) -> str:
        return f"--gpus-per-trial {self.per_run_gpus}"


def trial_slots(launch: LaunchOptions, gpus_per_trial: int | None, parallel: int | None,
                say: Callable[[str], None]) -> tuple[list[tuple[str, ...]], str]:
    """``(slots, kind)``: the GPU ids each concurrent trial gets (``()`` each on CPU), and ``cuda`` or ``cpu``.

    Raises:
        UsageError: ``--gpus-per-trial`` below 1, or beside ``--gpus``, ``--slurm``, ``--ray`` or ``--nnodes``.
        DeviceError: a trial needs more GPUs than are visible.
    """
    from nbddp.doors.batch.schedule import device_slots

    if gpus_per_trial is not None and gpus_per_trial < 1:
        raise UsageError(f"--gpus-per-trial {gpus_per_trial}: need at least 1")
    if parallel is not None and parallel < 1:
        raise UsageError(f"--parallel {parallel}: need at least 1")
    if (gpus_per_trial or parallel or 1) > 1 or gpus_per_trial:
        if launch.cluster_flag is not None or launch.nodes is not None:
            raise UsageError("concurrent trials share this machine's devices: drop --gpus-per-trial and --parallel "
                             "with --slurm, --ray or --nnodes")
        if gpus_per_trial is not None and launch.gpus is not None:
            raise UsageError("--gpus and --gpus-per-trial both say how many GPUs a trial uses: give one.")
    slots, _, kind = device_slots(SlotRequest(launch, parallel, gpus_per_trial), say)  # type: ignore[arg-type]
    return slots, kind


class Tickets:
    """How many trials the study has left to start, in a file of the study's folder that every worker takes from
    under a lock: the study runs exactly as many as asked, whichever worker is quickest."""

    def __init__(self, path: Path, count: int | None = None) -> None:
        self.path = path
        if count is not None:
            path.write_text(str(count), encoding="utf-8")

    def take(self) -> bool:
        """One trial to start (``False``: none left)."""
        with open(self.path, "r+", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            left = int(f.read().strip() or 0)
            if left <= 0:
                return False
            f.seek(0)
            f.truncate()
            f.write(str(left - 1))
            return True


def parent_alive(pid: int) -> bool:
    """Whether the process that started this worker is still its parent (a SIGKILLed study's workers are
    reparented)."""
    return os.getppid() == pid


@dataclass(frozen=True)
class Worker:
    """One worker process's command line: ``nbddp tune`` on a slot, given the study's storage and its tickets."""

    argv: list[str]
    env: dict[str, str]


def workers(notebook: Path, texts: Sequence[str], launch: LaunchOptions, slots: list[tuple[str, ...]], kind: str,
            study_argv: Sequence[str], tickets: Path, seed: int | None) -> list[Worker]:
    """One :class:`Worker` per slot: its GPUs pinned with ``CUDA_VISIBLE_DEVICES``, its own sampler seed."""
    made = []
    for index, slot in enumerate(slots):
        env = dict(os.environ)
        own = launch
        if kind == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(slot)
            own = replace(launch, gpus=str(len(slot)), cpu=False, nproc=None)
        argv = module_argv("nbddp", "tune", str(notebook), *study_argv,
                           *(word for text in texts for word in ("--space", text)),
                           *(("--seed", str(seed + index + 1)) if seed is not None else ()),
                           "--worker", f"{os.getpid()}:{tickets}", *own.to_argv())
        made.append(Worker(argv, env))
    return made


def run_workers(started: list[Worker], say: Callable[[str], None]) -> list[int]:
    """Start the workers, pass on each line they say, wait for them all; their exit codes.

    A Ctrl-C (or the command's SIGTERM) is passed on to every worker, which stops its trial's job; then it is
    raised here.
    """
    processes = [subprocess.Popen(w.argv, env=w.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
                 for w in started]
    readers = [threading.Thread(target=_relay, args=(p, say), daemon=True) for p in processes]
    for reader in readers:
        reader.start()
    try:
        while any(p.poll() is None for p in processes):
            time.sleep(POLL_SECONDS)
    except (KeyboardInterrupt, SignalReceived) as exc:
        stop_groups([p.pid for p in processes], stop_signal(exc), reap=lambda: [p.poll() for p in processes])
        raise
    finally:
        for reader in readers:
            reader.join(timeout=5)
    return [p.returncode for p in processes]


def _relay(process: subprocess.Popen, say: Callable[[str], None]) -> None:
    for line in process.stdout:
        say(line.rstrip("\n"))


def stop_if_orphaned(pid: int | None) -> None:
    """Raised into a worker's job (its heartbeat) once the study's process is gone: the job stops, the worker leaves.

    Raises:
        KeyboardInterrupt: the parent is gone.
    """
    if pid is not None and not parent_alive(pid):
        raise KeyboardInterrupt("the study's process is gone")
