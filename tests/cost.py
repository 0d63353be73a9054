"""What each test costs: seconds of wall time and CPU-seconds, its own process's and its children's.

The full tier runs in lanes that share a 2-core machine, so a test's wall time says as much about the tests beside
it as about itself; the CPU it burns (pytest's process, and every process the test started and waited for: kernels,
launchers, ranks) is what it takes from the others. ``--cost N`` prints the N costliest tests by CPU-seconds, with
their wall time, and the lane's totals; ``--cost-file PATH`` appends one JSON line per test (``.ci/run`` keeps them
to print the whole run's table: ``python -m tests.cost COSTS.jsonl …``, with each lane's time against
:data:`BUDGET`, which docs/contributing.md explains).

A process the test left to someone else (a Slurm or Ray daemon, a detached supervisor reparented to init) is not
counted: only what the test's own process tree reaped.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass

import pytest


#: Seconds each part of ``.ci/run`` may take on this kind of machine (2 cores), from a clean clone: the install, each
#: lane (they run at once: docs/contributing.md) and the whole. A lane over its budget is said at the end of the run.
BUDGET = {"install": 240, "main": 1380, "clusters": 1080, "beside": 1300, "3.13": 330, "total": 1500}


def _cpu() -> float:
    """CPU-seconds of this process and of every child it (or a descendant it reaped) waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass(frozen=True)
class Cost:
    nodeid: str
    wall: float
    cpu: float
    lane: str


class CostPlugin:
    def __init__(self, config: pytest.Config) -> None:
        self.shown = config.getoption("cost")
        self.path = config.getoption("cost_file")
        self.lane = config.getoption("cost_lane") or config.getoption("markexpr") or "fast tier"
        self.costs: list[Cost] = []
        self.started = time.monotonic()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        wall, cpu = time.monotonic(), _cpu()
        yield
        cost = Cost(item.nodeid, time.monotonic() - wall, _cpu() - cpu, self.lane)
        self.costs.append(cost)
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(cost.__dict__) + "\n")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.shown or not self.costs:
            return
        write = terminalreporter.write_line
        terminalreporter.section(f"costliest {self.shown} tests (CPU-seconds: this process and what it reaped)")
        for cost in sorted(self.costs, key=lambda c: -c.cpu)[: self.shown]:
            write(f"{cost.cpu:7.1f} CPU-s {cost.wall:7.1f} s  {cost.nodeid}")
        write(f"{sum(c.cpu for c in self.costs):7.0f} CPU-s in all, {len(self.costs)} tests, "
              f"{time.monotonic() - self.started:.0f} s ({self.lane})")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cost", "what each test costs")
    group.addoption("--cost", type=int, default=0, metavar="N",
                    help="print the N costliest tests by CPU-seconds (with their wall time)")
    group.addoption("--cost-file", default=None, metavar="PATH", help="append one JSON line per test to PATH")
    group.addoption("--cost-lane", default=None, metavar="NAME", help="the lane the --cost-file lines name")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CostPlugin(config), "nbddp-cost")


def summary(costs: list[Cost], lanes: dict[str, tuple[int, int]], started: int, installed: int, ended: int,
            top: int) -> list[str]:
    """The lines ``.ci/run`` ends with: each part's time against its budget, then the costliest tests."""
    rows = [("install", installed - started, "")]
    for name, (begin, end) in lanes.items():
        mine = [c for c in costs if c.lane == name]
        rows.append((name, end - begin, f"from {begin - started} s to {end - started} s, "
                                        f"{len(mine)} tests, {sum(c.cpu for c in mine):.0f} CPU-s"))
    rows.append(("total", ended - started, ""))
    lines = []
    for name, seconds, note in rows:
        budget = BUDGET.get(name)
        over = f"  OVER ITS BUDGET of {budget} s (docs/contributing.md)" if budget and seconds > budget else ""
        lines.append(f"{name:<9} {seconds:5d} s{f' of {budget}' if budget else '':>8}  {note}{over}".rstrip())
    lines.append(f"the costliest {top} tests (CPU-seconds, wall seconds under the other lanes' load):")
    for cost in sorted(costs, key=lambda c: -c.cpu)[:top]:
        lines.append(f"  {cost.cpu:6.1f} CPU-s {cost.wall:6.1f} s  {cost.lane:<8}  {cost.nodeid}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="What .ci/run cost: each lane's time, the costliest tests.")
    parser.add_argument("costs", help="the --cost-file of every lane")
    parser.add_argument("lanes", nargs="*", metavar="NAME=START:END", help="each lane's start and end (epoch s)")
    parser.add_argument("--started", type=int, required=True)
    parser.add_argument("--installed", type=int, required=True)
    parser.add_argument("--ended", type=int, required=True)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_intermixed_args(argv)
    try:
        with open(args.costs, encoding="utf-8") as f:
            costs = [Cost(**json.loads(line)) for line in f if line.strip()]
    except OSError:
        costs = []
    lanes = {}
    for given in args.lanes:
        name, _, times = given.partition("=")
        begin, _, end = times.partition(":")
        lanes[name] = (int(begin), int(end or args.ended))
    print("\n".join(summary(costs, lanes, args.started, args.installed, args.ended, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
