"""The ranks' peak memory, as :mod:`nbddp.rank_side.memory` reports it: read for the view, the ending and
``result.json``, and said in a few words. Nothing here imports torch."""

from __future__ import annotations


from nbddp.contracts.atomic import read_json
from nbddp.contracts.rundir import RunDir, rank_of


def read_peaks(run_dir: RunDir) -> dict[int, int]:
    """``{rank: peak bytes}`` of every rank that reported; unreadable reports skipped."""
    peaks: dict[int, int] = {}
    for path in run_dir.memory_reports():
        try:
            peaks[rank_of(path)] = int(read_json(path)["peak_bytes"])
        except (ValueError, KeyError, TypeError, IndexError):
            continue
    return dict(sorted(peaks.items()))


def size(n: int) -> str:
    """``1288490188`` → ``1.2 GB`` (decimal units, as ``free`` and ``nvidia-smi`` users read them)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"


def describe(peaks: dict[int, int]) -> str:
    """``peak memory 1.2 GB, 1.21 GB (ranks 0-1)``: each rank's, in rank order (``""`` when none reported)."""
    if not peaks:
        return ""
    ranks = list(peaks)
    which = f"rank {ranks[0]}" if len(ranks) == 1 else (
        f"ranks {ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else
        "ranks " + ",".join(map(str, ranks)))
    shown = [size(v) for v in peaks.values()]
    if len(shown) > 8:
        shown = [f"{size(min(peaks.values()))} to {size(max(peaks.values()))}"]
    return f"peak memory {', '.join(shown)} ({which})"
