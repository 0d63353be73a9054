"""Where ``nbddp run``'s training throughput goes: ``python -m benchmarks.throughput [--rounds N] [--steps N]``.

Section 2 of the suite runs two rounds of long jobs; on a shared 2-core machine one slow moment moves a
median by several percent, more than the gap it is meant to show. This runs section 2's three cases
(the hand-written torchrun script, nbddp's export of the same notebook under plain torchrun, ``nbddp
run``) for more, shorter rounds, interleaved, and writes BENCHMARKS.md's "throughput" block (``--out``).
The exported script has nbddp's runtime in its ranks and nothing else of nbddp, so comparing it with
the hand-written script measures the ranks' code, and ``nbddp run`` against it measures what runs beside
the ranks (the kernel, the front end's polling, the log files).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.document import replace_block
from benchmarks.suite import ENV, PYTHON, TORCHRUN, machine, throughput, throughput_lines, write_training


def cpu_shares(work: Path, rounds: int, steps: int) -> dict[str, list[tuple[float, float]]]:
    """Per case (by hand, ``nbddp run``): the cores its ranks used, and the cores all its other processes used
    (torchrun's agent; with nbddp also the front end and the kernel), sampled with psutil every second over the
    middle of the training."""
    import psutil

    write_training(work, "shares_hand.py", "shares.ipynb", steps)
    cases = {"torchrun by hand": (TORCHRUN + ["shares_hand.py"], "shares_hand.py"),
             "nbddp run": ([PYTHON, "-m", "nbddp", "run", "shares.ipynb", "--cpu", "--nproc", "2"], "train.py")}
    found: dict[str, list[tuple[float, float]]] = {case: [] for case in cases}
    for _ in range(rounds):
        for case, (argv, script) in cases.items():
            proc = subprocess.Popen(argv, cwd=work, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            root, samples = psutil.Process(proc.pid), []
            while proc.poll() is None:
                snapshot = {}
                for each in [root, *root.children(recursive=True)]:
                    try:
                        argv_ = each.cmdline()
                        rank = bool(argv_) and argv_[-1].endswith(script) and "-m" not in argv_  # (not an agent)
                        times = each.cpu_times()
                        snapshot[each.pid] = (rank, times.user + times.system)
                    except psutil.Error:
                        continue
                samples.append((time.monotonic(), snapshot))
                time.sleep(1)
            shutil.rmtree(work / "runs", ignore_errors=True)
            training = [s for s in samples if sum(rank for rank, _ in s[1].values()) == 2]
            first, last = training[len(training) // 4], training[-3]
            used = {True: 0.0, False: 0.0}
            for pid, (rank, cpu) in last[1].items():
                if pid in first[1]:
                    used[rank] += cpu - first[1][pid][1]
            seconds = last[0] - first[0]
            found[case].append((used[True] / seconds, used[False] / seconds))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2500, help="steps per job (~140 steps/s on 2 CPU cores)")
    parser.add_argument("--out", type=Path, default=None, help="write the section into this BENCHMARKS.md")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="nbddp-throughput-"))
    ENV["TMPDIR"] = str(work)  # torchrun by hand leaves its torchelastic_* folder there
    try:
        rates = throughput(work, args.rounds, args.steps)
        shares = cpu_shares(work, 2, 3000)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = "\n".join([
        f"## 11. Training throughput, attributed ({args.steps} steps per job, {args.rounds} rounds)", "",
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {machine()}; `python -m benchmarks.throughput "
        f"--rounds {args.rounds} --steps {args.steps}`. Section 2's cases, more and shorter rounds, interleaved; "
        "steps/s in the ranks, medians (min–max).", "",
        *throughput_lines(rates, pointer=False), "",
        "Where the CPU goes while they train (`psutil`, every second, over the middle of a 3000-step job; 2 rounds):", "",
        "| case | the ranks | everything else of the run |", "|---|---|---|",
        *(f"| {case} | {', '.join(f'{r:.3f}' for r, _ in values)} cores | {', '.join(f'{o:.3f}' for _, o in values)} "
          "cores |" for case, values in shares.items()), ""])
    print(text)
    if args.out:
        replace_block(args.out, "throughput", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
