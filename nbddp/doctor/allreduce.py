"""The all-reduce a run's first collective is, on this machine's devices: N ranks, the backend a run would use.

:func:`attempt` (in the ``allreduce`` check's subprocess) starts the ranks, ``python -m nbddp.doctor.allreduce``
each, meeting as a run's ranks on one machine do (a file of a private folder, loopback connections), and waits for
them at most the check's limit: they all-reduce a 16 MiB tensor (big enough for NCCL to use its peer-to-peer or
shared-memory transport, not only its smallest path) and check the sum. It answers ``ok``, ``hung`` (a rank was
still waiting at the limit: the ranks are killed) or ``failed`` (a rank raised: its last line). Which transport
hangs is found by :func:`nbddp.doctor.examine.transports`, which calls it again with NCCL's transports turned off one
by one.

The fault hook (``NBDDP_DOCTOR_FAULT=hang``, the tests' only): the last rank meets the others, then never joins the
all-reduce, so they wait in it as ranks on a transport that hangs do.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nbddp.contracts.interpreter import module_argv
from nbddp.contracts.process_groups import owned_temp_dir
from nbddp.launchers import private_rendezvous
from nbddp.rank_side.parent_death import arm

#: Floats all-reduced: 16 MiB.
ELEMENTS = 4 * 2**20
#: The tests' fault hook: ``hang`` keeps the last rank out of the all-reduce.
FAULT_VARIABLE = "NBDDP_DOCTOR_FAULT"
#: The file the ranks meet in (a FileStore in a private folder, as a run's ranks on one machine meet).
STORE_VARIABLE = "NBDDP_DOCTOR_STORE"
#: The most CPU ranks the all-reduce starts: each imports torch, and a hang between 4 is a hang between 64.
CPU_RANKS = 4
#: The least time the ranks get to import torch (``torch`` takes 1-2 s; 7 s on a loaded 2-core machine).
IMPORT_SECONDS = 30.0
#: How often the ranks are looked at while they run.
POLL_SECONDS = 0.05


def ranks_for(kind: str, nproc: int) -> int:
    """The all-reduce's ranks: the run's, at most :data:`CPU_RANKS` on the CPU."""
    return nproc if kind == "cuda" else min(nproc, CPU_RANKS)


def attempt(backend: str, nproc: int, limit: float, fault: str = "",
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """One all-reduce of ``nproc`` ranks: ``{"state": "ok"|"hung"|"failed", "seconds", ...}``.

    The ranks meet as a run's on one machine do (:mod:`nbddp.launchers.private_rendezvous`): in a file of a private
    folder, their connections on the loopback interface. ``limit`` counts from when every rank has imported torch
    (they get :data:`IMPORT_SECONDS` at least for that: a loaded machine's imports are no hang, and the ``versions``
    check finds an import that is), for them to meet and all-reduce.
    """
    folder = Path(owned_temp_dir("nbddp-doctor-"))
    try:
        return _attempt(backend, nproc, limit, fault, env or {}, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _attempt(backend: str, nproc: int, limit: float, fault: str, env: dict[str, str], folder: Path) -> dict[str, Any]:
    base = {**os.environ, **env, **private_rendezvous.environment(private_rendezvous.prepare(folder / "store"), env),
            "WORLD_SIZE": str(nproc), "NBDDP_DOCTOR_BACKEND": backend, "NBDDP_DOCTOR_LIMIT": str(limit),
            FAULT_VARIABLE: fault, STORE_VARIABLE: str(folder / "store" / "allreduce")}
    started = time.monotonic()
    ranks = [subprocess.Popen(module_argv("nbddp.doctor.allreduce"), env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(nproc)]
    stages: dict[int, list[str]] = {r: [] for r in range(nproc)}
    errors: dict[int, list[str]] = {r: [] for r in range(nproc)}  # (drained as written: a full pipe would block it)
    readers = [threading.Thread(target=lambda lines=lines, stream=stream: lines.extend(x.strip() for x in stream),
                                daemon=True)
               for r in range(nproc) for lines, stream in ((stages[r], ranks[r].stdout), (errors[r], ranks[r].stderr))]
    for reader in readers:
        reader.start()
    try:
        deadline = started + max(limit, IMPORT_SECONDS)
        imported = False
        while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
            if any(rank.poll() not in (None, 0) for rank in ranks):
                break  # (a rank raised: the others would wait for it until the limit)
            if not imported and all(stages[r] for r in range(nproc)):
                imported, deadline = True, time.monotonic() + limit
            time.sleep(POLL_SECONDS)
        seconds = round(time.monotonic() - started, 2)
        failed = [r for r, rank in enumerate(ranks) if rank.poll() not in (None, 0)]
        waiting = [r for r, rank in enumerate(ranks) if rank.poll() is None]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
        for rank in ranks:
            rank.wait()
        for reader in readers:
            reader.join(5)
    if failed:
        said = [line for line in errors[failed[0]] if line] or ["(no output)"]
        return {"state": "failed", "seconds": seconds, "error": f"rank {failed[0]}: {said[-1][:300]}"}
    if waiting:
        return {"state": "hung", "seconds": seconds, "waiting": waiting,
                "stages": {r: (stages[r] or [STARTING])[-1] for r in waiting}}
    return {"state": "ok", "seconds": seconds}


#: Where a rank got to, as it prints it: torch imported, it met the others (``init_process_group`` returned), it
#: entered the all-reduce (a rank that printed nothing was still importing torch).
STARTING, IMPORTED, MET, REDUCING = "starting", "imported", "met", "reducing"


def stuck(stages: dict[int, str]) -> str:
    """``rank 0 waited in the all-reduce; rank 1 met the others but never reached it``: where hung ranks were."""
    where = {STARTING: "never finished importing torch", IMPORTED: "never met the others",
             MET: "met the others but never reached it", REDUCING: "waited in the all-reduce"}
    said = []
    for stage in (REDUCING, MET, IMPORTED, STARTING):
        ranks = [str(r) for r, s in sorted(stages.items()) if s == stage]
        if ranks:
            said.append(f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)} {where[stage]}")
    return "; ".join(said) or "no rank said where it was"


def main() -> None:
    """One rank: meet the others, all-reduce, check the sum; exit 1 with the error on stderr if it is wrong."""
    arm(signal.SIGKILL)  # (dies with the check's process, whatever ends it)
    import datetime

    import torch
    import torch.distributed as dist

    print(IMPORTED, flush=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend, limit = os.environ["NBDDP_DOCTOR_BACKEND"], float(os.environ["NBDDP_DOCTOR_LIMIT"])
    from nbddp.rank_side.torch_engine import group_backend

    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    store = dist.FileStore(os.environ[STORE_VARIABLE], world)
    dist.init_process_group(**group_backend(cuda, rank), store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=limit))
    print(MET, flush=True)
    try:
        tensor = torch.full((ELEMENTS,), float(rank + 1), device=device)
        if os.environ.get(FAULT_VARIABLE) == "hang" and rank == world - 1:
            time.sleep(limit * 10)  # (killed before this ends)
        print(REDUCING, flush=True)
        dist.all_reduce(tensor)
        expected = world * (world + 1) / 2
        got = float(tensor[0].item())
        if got != expected or float(tensor[-1].item()) != expected:
            sys.exit(f"the all-reduce's sum was {got}, not {expected}: the transport corrupts data")
    finally:
        dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
