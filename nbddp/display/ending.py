"""How a run ended, said once: one line with the time, where the weights went and the run dir.

Every front door ends a run with exactly one such line (the terminal's ``nbddp run``, the
``%%ddp_train`` view and its static copy), so the four outcomes read the same everywhere:

    succeeded in 11.3s · model loaded on the CPU · run dir runs/digits-20261122-101500
    failed after 4.6s · rank 1 raised ValueError: boom · no weights came back · run dir …
    interrupted after 3.2s · every rank stopped · no weights came back · run dir …
    timed out after 60.0s · … · run dir …

The final metrics are shown once, beside it, without the counters (epoch, step, …), with each rank's
peak memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbddp.contracts.metrics import format_metrics, measures
from nbddp.contracts.rank_memory import describe as describe_memory
from nbddp.contracts.rank_memory import size
from nbddp.contracts.status import Status

if TYPE_CHECKING:
    from nbddp.job.orchestrator import KernelResult, RunResult

_VERBS = {Status.SUCCEEDED: "succeeded in", Status.FAILED: "failed after", Status.INTERRUPTED: "interrupted after",
          Status.TIMEOUT: "timed out after", "detached": "stopped following after"}
NO_WEIGHTS = "no weights came back"


@dataclass(frozen=True)
class Ending:
    status: str
    """A :class:`nbddp.job.outcome.Status` value (``succeeded``, ``failed``, ``timeout``, ``interrupted``)."""
    seconds: float
    run_dir: Path | None
    weights: str = NO_WEIGHTS
    """Where the weights went: ``model loaded on the CPU``, a path, or :data:`NO_WEIGHTS`."""
    reason: str = ""
    """Why it didn't succeed, in a few words (the first line of the error)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    memory: dict[int, int] = field(default_factory=dict)
    """Each rank's peak memory in bytes (:mod:`nbddp.contracts.rank_memory`)."""
    dropped: dict[int, int] = field(default_factory=dict)
    """Bytes of each rank's output its log didn't keep beyond ``--log-cap`` (:mod:`nbddp.rank_side.log_cap`)."""
    restarts: int = 0
    """How often torchrun started the ranks again (``--max-restarts``)."""

    @property
    def succeeded(self) -> bool:
        return self.status == Status.SUCCEEDED

    def line(self) -> str:
        parts = [f"{_VERBS.get(self.status, self.status)} {self.seconds:.1f}s"
                 + (f" after {self.restarts} restart{'s' * (self.restarts > 1)}" if self.restarts else "")]
        if self.reason:
            parts.append(self.reason.rstrip("."))  # (a sentence's end in the middle of the line: not there)
        if self.weights:
            parts.append(self.weights)
        if self.run_dir is not None:
            parts.append(f"run dir {shown_path(self.run_dir)}")
        return " · ".join(parts)

    def metrics_line(self) -> str:
        """``final metrics: loss=0.0213 accuracy=0.98 · peak memory 1.2 GB, 1.2 GB (ranks 0-1)``, or ``""`` when
        there are neither metrics (besides counters) nor memory reports."""
        shown = final_metrics(self.metrics)
        parts = [f"final metrics: {format_metrics(shown)}"] if shown else []
        if self.memory:
            parts.append(describe_memory(self.memory))
        if self.dropped:
            ranks = ", ".join(f"rank {rank} {size(n)}" for rank, n in self.dropped.items())
            parts.append(f"logs capped (--log-cap), output not kept: {ranks} (each log keeps its start and last lines)")
        return " · ".join(parts)


def ending_of(result: "RunResult", reason: str = "") -> Ending:
    """The one line ``result``'s run ends with (``reason``: why it didn't succeed, in a few words)."""
    metrics = result.record.final_metrics if result.record else {}
    memory = {int(rank): peak for rank, peak in result.record.peak_memory.items()} if result.record else {}
    dropped = {int(rank): n for rank, n in result.record.dropped_output.items()} if result.record else {}
    return Ending(result.status, result.seconds, result.run_dir, weights_went(result.kernel), reason, metrics, memory,
                  dropped, result.record.restarts if result.record else 0)


def weights_went(kernel: "KernelResult") -> str:
    """Where the weights went, for the ending line: the names the kernel loaded them into, else what it noted
    (the checkpoint Catalyst kept; ``node 0 holds the weights``), else :data:`NO_WEIGHTS`."""
    if kernel.loaded:
        return f"{', '.join(kernel.loaded)} loaded on the CPU" + (f" ({kernel.note})" if kernel.note else "")
    return kernel.note or NO_WEIGHTS


def final_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    return measures(metrics)


def first_line(text: str, limit: int = 160) -> str:
    line = next((part.strip() for part in str(text).splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def shown_path(path: Path) -> str:
    """``path`` relative to the working directory when it lies inside it (shorter to read)."""
    try:
        relative = Path(path).resolve().relative_to(Path(os.getcwd()).resolve())
        return str(relative) if str(relative) != "." else str(path)
    except (ValueError, OSError):
        return str(path)
