"""How long ``nbddp doctor`` takes on a healthy machine: ``python -m benchmarks.doctor [--rounds N] [--out DOC]``.

Each round is a fresh ``nbddp doctor --cpu --json`` process (what a user types before a CPU run: every check that
applies, the 2-rank gloo all-reduce included), from an empty folder. The wall time of each round, as a median
(min–max), against the issue's bound of 10 s; and each check's own time, median over the rounds (the checks run at
once, so the slowest one sets the total). The figures go into BENCHMARKS.md's "doctor" block (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.document import replace_block
from benchmarks.suite import machine

#: The issue's bound for the whole doctor on a healthy machine.
BOUND = 10.0


def one_round() -> tuple[float, dict[str, float]]:
    with tempfile.TemporaryDirectory() as folder:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "nbddp", "doctor", "--cpu", "--json"], cwd=folder,
                              capture_output=True, text=True, timeout=120)
        wall = time.monotonic() - started
    report = json.loads(done.stdout)
    if not report["ok"]:
        raise SystemExit(f"the doctor found a problem; the benchmark needs a healthy machine:\n{done.stdout}")
    return wall, {check["check"]: check["seconds"] for check in report["checks"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the figures into this document (BENCHMARKS.md)")
    args = parser.parse_args(argv)
    rounds = [one_round() for _ in range(args.rounds)]
    walls = [wall for wall, _ in rounds]
    checks = {name: statistics.median(r[1][name] for r in rounds) for name in rounds[0][1]}
    total = statistics.median(walls)
    lines = [
        f"## 13. `nbddp doctor` on a healthy machine ({args.rounds} rounds)", "",
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {machine()}; `python -m benchmarks.doctor "
        f"--rounds {args.rounds}`. Each round is a fresh `nbddp doctor --cpu --json` process from an empty folder.", "",
        f"Total wall time: **{total:.1f} s** median ({min(walls):.1f}–{max(walls):.1f}); the bound is {BOUND:g} s: "
        f"**{'met' if max(walls) <= BOUND else 'missed'}** in every round." if max(walls) <= BOUND else
        f"Total wall time: **{total:.1f} s** median ({min(walls):.1f}–{max(walls):.1f}); the bound is {BOUND:g} s: "
        f"**missed** in {sum(w > BOUND for w in walls)} of {len(walls)} rounds.", "",
        "| check | median seconds |", "|---|---|",
        *(f"| `{name}` | {seconds:.2f} |" for name, seconds in checks.items()), "",
        "The checks run at once, each in a process of its own; `versions` and `allreduce` import torch (the "
        "all-reduce's two ranks each), which is most of the time.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        replace_block(args.out, "doctor", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
