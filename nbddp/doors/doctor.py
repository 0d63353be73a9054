"""``nbddp doctor`` and ``%ddp_doctor``: the doctor's options and its report, for the terminal and a kernel.

The options are ``nbddp run``'s that say where the ranks run (devices, nodes, Slurm, Ray: the same declarations,
so ``nbddp doctor --gpus 4`` examines what ``nbddp run nb.ipynb --gpus 4`` would meet), with the doctor's own:
``--run-dir``, ``--workers``, ``--check`` and ``--json``. The checks are :mod:`nbddp.doctor`'s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from nbddp.doctor.ask import CHECKS, DEFAULT_WORKERS, asked_within
from nbddp.plan.options import RUN, WHERE, add_launch_arguments, launch_options

if TYPE_CHECKING:
    from nbddp.doctor.examine import Report


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser, RUN, only=WHERE)
    own = parser.add_argument_group("the doctor")
    own.add_argument("--run-dir", type=Path, default=None, metavar="PATH",
                     help="a run dir you would give nbddp run: it, or the folder it would be made in, is checked "
                          "(default: runs/ here, where a notebook of this folder writes its runs)")
    own.add_argument("--workers", type=int, default=DEFAULT_WORKERS, metavar="N",
                     help=f"DataLoader workers per rank, for what /dev/shm and the open files must hold "
                          f"(default {DEFAULT_WORKERS})")
    own.add_argument("--check", action="append", choices=CHECKS, metavar="NAME", dest="checks",
                     help=f"only this check (repeatable): {', '.join(CHECKS)}")
    own.add_argument("--json", action="store_true", help="the report as JSON, for scripts")


def run_doctor(args: argparse.Namespace, say: Callable[[str], None], own_pid: int | None = None,
               ours: tuple[str, ...] = ()) -> Report:
    """Examine what ``args`` asks for and say the report (lines, or JSON with ``--json``). ``own_pid``, ``ours``: the
    kernel asking, and the GPUs its warm ranks hold (said as its own, not as someone else's)."""
    from nbddp.doctor.examine import examine, text

    own = {name: getattr(args, name) for name in ("run_dir", "workers", "checks", "json")}
    for name in own:
        delattr(args, name)
    if own["workers"] < 0:
        from nbddp.contracts.errors import UsageError

        raise UsageError(f"--workers {own['workers']}: give 0 or more.")
    ask = asked_within(launch_options(args), own["run_dir"], own["workers"], own_pid, ours)
    report = examine(ask, own["checks"] or ())
    if own["json"]:
        say(json.dumps(report.to_dict(), indent=2))
    else:
        for line in text(report):
            say(line)
    return report
