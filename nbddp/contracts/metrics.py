"""The records ``nbddp.log(...)`` writes (``metrics.jsonl``): read, split into counters and measures, shown.

A record's keys are either *counters* (where the run is: epoch, step, …), which place a record
but are never drawn or compared, or *measures* (loss, accuracy, …). :data:`COUNTERS` is the one
list of them, used by the live view, the plot, the ending line and a batch's summary.
"""

from __future__ import annotations

import json
import math
from typing import Any

from nbddp.contracts.rundir import RunDir

#: Keys of an ``nbddp.log`` record that count rather than measure; ``time`` is when it was logged.
COUNTERS = frozenset({"epoch", "epochs", "step", "steps", "time"})


def read_metrics(run_dir: RunDir) -> list[dict[str, Any]]:
    """Every ``nbddp.log`` record of a run, in order; unreadable lines skipped."""
    path = run_dir.metrics
    records: list[dict[str, Any]] = []
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def last_metrics(run_dir: RunDir) -> dict[str, Any]:
    """The final ``nbddp.log`` record (without its timestamp)."""
    records = read_metrics(run_dir)
    return {k: v for k, v in records[-1].items() if k != "time"} if records else {}


def measures(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its counters."""
    return {k: v for k, v in record.items() if k not in COUNTERS}


def curves(record: dict[str, Any]) -> dict[str, float]:
    """The values of a record worth plotting: finite numbers that aren't counters."""
    return {k: float(v) for k, v in measures(record).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def format_metrics(values: dict) -> str:
    """``loss=0.0213 accuracy=0.98`` (the timestamp left out)."""
    shown = {k: v for k, v in values.items() if k != "time"}
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())


def step_of(record: dict[str, Any], index: int) -> int:
    """The step an ``nbddp.log`` record was logged at, for a tracker's x axis: its ``step``, else its ``epoch``,
    else its place among the records (``index``)."""
    try:
        return int(float(record.get("step", record.get("epoch", index))))
    except (TypeError, ValueError):
        return index
