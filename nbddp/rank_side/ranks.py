"""Who this process is among the job's ranks, and what rank 0 alone says: ``nbddp.rank()``,
``world_size()``, ``local_rank()``, ``is_main()``, ``device()`` and ``nbddp.log(...)``.

Part of the training cells' API, which :mod:`nbddp.rank_side.torch_engine` offers (``nbddp.rank`` and the
others are these); here, below the engines' glue, so that the libraries' adaptations
(:mod:`nbddp.rank_side.frameworks`), which the glue starts, use them without importing the glue back.
Run without a launcher, each answers for a plain single process.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from nbddp.contracts.rank_env import RankEnv
from nbddp.rank_side import trackers
from nbddp.rank_side.process import run_dir


def rank() -> int:
    """Global rank of this process (0 in a single process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of processes in the job (1 in a single process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    """Rank on this machine: which GPU this process drives."""
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    """True on rank 0: the one process that logs metrics and saves weights."""
    return rank() == 0


def device() -> torch.device:
    """``cuda:<local_rank>`` on a GPU run, else ``cpu``."""
    if use_cuda():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def use_cuda() -> bool:
    """Whether this rank drives a GPU: one is there, and the launcher didn't say ``cpu``."""
    return RankEnv.from_environ().device != "cpu" and torch.cuda.is_available()


def log(**metrics: Any) -> None:
    """Record metrics (epoch, step, loss, …) from rank 0: ``metrics.jsonl`` and the live view.

    Other ranks' calls are ignored, so the training loop needs no ``if``.
    """
    if not is_main():
        return
    record = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
    directory = run_dir()
    if directory is None:
        print("[nbddp.log] " + " ".join(f"{k}={v}" for k, v in record.items()), flush=True)
        return
    record["time"] = time.time()
    with open(directory.metrics, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
    trackers.note_metrics(record)
