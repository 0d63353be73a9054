"""Each rank's peak memory, where the live view and ``result.json`` read it (``ranks/memory-N.json``).

The number that says what sharding saved: on a GPU rank CUDA's peak allocated memory, on a CPU rank the
process's peak resident set (``VmHWM``). A daemon thread writes it when it has grown, at most once a
second, and :func:`report` writes the final value as a rank finishes. A warm rank runs job after job in
one process: :func:`watch` starts each job's count from zero (CUDA's peak statistics, and Linux's
peak RSS through ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from nbddp.contracts.atomic import write_json
from nbddp.contracts.rank_env import RankEnv

INTERVAL = 1.0
#: Growth smaller than this is not worth a write.
STEP_BYTES = 1 << 20

_target: tuple[Path, int] | None = None
_written: tuple[int, str] = (0, "")
_cuda_device = 0
"""The rank's GPU: the reporting thread asks for it by index (CUDA's current device is per thread)."""
_lock = threading.Lock()
_thread: threading.Thread | None = None


def peak_bytes() -> tuple[int, str]:
    """``(bytes, kind)``: CUDA's peak allocated memory on a GPU rank, else the process's peak RSS."""
    import torch

    if _uses_cuda():
        return int(torch.cuda.max_memory_allocated(_cuda_device)), "cuda"
    return _peak_rss(), "rss"


def _uses_cuda() -> bool:
    """A GPU rank whose CUDA is in use. A CPU rank (``NBDDP_DEVICE=cpu``: ``--cpu`` on a machine with GPUs)
    reports its RSS even if something in it touched CUDA, and never probes the driver (``is_initialized``
    asks torch; ``is_available`` would start the CUDA driver in every CPU rank, every second)."""
    import torch

    return RankEnv.from_environ().device != "cpu" and torch.cuda.is_initialized()


def _peak_rss() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _reset_peak() -> None:
    import torch

    if _uses_cuda():
        torch.cuda.reset_peak_memory_stats(_cuda_device)
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux 4.0+)
    except OSError:
        pass  # elsewhere the peak is the process's, since it started


def watch(path: Path | None, rank: int = 0, fresh: bool = False) -> None:
    """Report this rank's peak to ``path`` from now on (``None``: stop reporting); ``fresh``: count it from now."""
    global _target, _written, _thread, _cuda_device
    import os

    with _lock:
        _cuda_device = int(os.environ.get("LOCAL_RANK", 0) or 0)
        if fresh:
            _reset_peak()
        _target, _written = (None if path is None else (Path(path), rank)), (0, "")
    if path is not None:
        report()
        if _thread is None:
            _thread = threading.Thread(target=_loop, name="nbddp-memory", daemon=True)
            _thread.start()


def report() -> None:
    """Write the peak now, when it grew since the last write."""
    global _written
    with _lock:
        if _target is None:
            return
        peak, kind = peak_bytes()
        if kind == _written[1] and peak - _written[0] < STEP_BYTES:
            return  # (a rank that starts CUDA after its first report changes kind: a new count)
        path, rank = _target
        try:
            write_json(path, {"rank": rank, "peak_bytes": peak, "kind": kind, "time": time.time()})
            _written = (peak, kind)
        except OSError:
            pass  # the run dir is gone (the job ended): nothing to report to


def _loop() -> None:
    while True:
        time.sleep(INTERVAL)
        report()
