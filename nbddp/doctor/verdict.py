"""A check's answer: ok, or one line saying what is wrong, what it breaks and the fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: A check's states: it passed, it found a problem, or it doesn't apply to this run (said why).
OK, PROBLEM, SKIPPED = "ok", "problem", "skipped"


@dataclass(frozen=True)
class Verdict:
    check: str
    state: str
    line: str
    """ok: what was found; a problem: ``WRONG: BREAKS. Fix: FIX``; skipped: why it doesn't apply."""
    seconds: float = 0.0
    found: dict[str, Any] = field(default_factory=dict)
    """What the check measured (sizes, limits, versions, holders), for ``--json``."""

    @property
    def passed(self) -> bool:
        return self.state != PROBLEM

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ok(check: str, line: str, **found: Any) -> Verdict:
    return Verdict(check, OK, line, found=found)


def problem(check: str, wrong: str, breaks: str, fix: str, **found: Any) -> Verdict:
    """What is wrong, what it breaks, and what to change: the one line every problem is said in."""
    return Verdict(check, PROBLEM, f"{wrong}: {breaks}. Fix: {fix}", found=found)


def skipped(check: str, why: str) -> Verdict:
    return Verdict(check, SKIPPED, why)
