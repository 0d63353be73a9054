"""Soak test: many small 2-rank runs through every front door, back to back and several at once,
beside a CPU hog, counting what must never happen.

    python -m benchmarks.soak --runs 200 --parallel 2 --hog 1 --write docs/reliability.md

Each run trains a tiny DDP model on CPU (gloo, 2 ranks); every rank prints ``LINES`` numbered lines.
The runs go through ``nbddp run`` (a CLI process), ``%%ddp_train`` (several cells in one real
kernel driven by nbclient) and ``nbddp batch`` (two runs at once), in rotation. Counted:

* **spurious failures**: a run whose ranks all wrote their ``done`` mark (training finished) but
  that is not ``succeeded``; also every other failure, which a soak of good runs must not have;
* **processes left behind**: any process whose working folder or command line is inside the soak
  folder once everything has ended (ranks, launchers and kernels all run there);
* **temp files left behind**: every child runs with ``TMPDIR`` set to a private folder, which must
  be empty at the end (torchrun's log folders and the kernels' socket folders went there);
* **lines lost**: each numbered line of each rank must reach what the user sees: the terminal
  for ``nbddp run``, the cell's output for ``%%ddp_train``, the executed notebook for ``batch``.

The short version of this runs in CI (``tests/test_soak.py``); the long one writes its figures into
docs/reliability.md between the ``soak`` markers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import nbformat
from nbformat import NotebookNode
from nbformat.v4 import new_code_cell, new_notebook

from benchmarks.document import replace_block

WORLD_SIZE = 2
FRONTS = ("run", "magic", "batch")
#: Runs per job of each front door: one CLI run; several ``%%ddp_train`` cells in one kernel;
#: a batch of two runs going at once.
RUNS_PER_JOB = {"run": 1, "magic": 3, "batch": 2}
_LINE = re.compile(r"soak rank (\d+) line (\d+)\b")

TRAIN = """\
ddp_model = nbddp.prepare(model)
optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
for i in range(lines):
    optimizer.zero_grad()
    ddp_model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    print(f"soak rank {nbddp.rank()} line {i}", flush=True)
nbddp.log(epoch=1, epochs=1, loss=float(i))"""
SETUP = "import torch, nbddp\ntorch.manual_seed(seed)\nmodel = torch.nn.Linear(4, 2)"


@dataclass
class RunCheck:
    """What one run did, as the soak judges it."""

    front: str
    name: str
    status: str
    ranks_done: bool
    lines_lost: int
    seconds: float
    message: str = ""

    @property
    def spurious(self) -> bool:
        return self.ranks_done and self.status != "succeeded"


@dataclass
class SoakReport:
    runs: list[RunCheck]
    leftover_processes: list[str]
    leftover_temp: list[str]
    wall_s: float
    parallel: int
    hogs: int
    lines: int
    started: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))

    @property
    def spurious_failures(self) -> list[RunCheck]:
        return [r for r in self.runs if r.spurious]

    @property
    def failures(self) -> list[RunCheck]:
        return [r for r in self.runs if r.status != "succeeded"]

    @property
    def lines_lost(self) -> int:
        return sum(r.lines_lost for r in self.runs)

    @property
    def clean(self) -> bool:
        return not (self.failures or self.leftover_processes or self.leftover_temp or self.lines_lost)

    def markdown(self, command: str) -> str:
        per_front = {f: [r for r in self.runs if r.front == f] for f in FRONTS}
        rows = "\n".join(
            f"| {front} | {len(runs)} | {sum(r.status != 'succeeded' for r in runs)} | "
            f"{sum(r.spurious for r in runs)} | {sum(r.lines_lost for r in runs)} | "
            f"{_median([r.seconds for r in runs]):.1f} |"
            for front, runs in per_front.items() if runs)
        failures = "".join(f"\n- {r.front} {r.name}: {r.status}: {r.message.splitlines()[0] if r.message else ''}"
                           for r in self.failures)
        return (
            f"Measured {self.started} on {platform.node() or 'this machine'} ({os.cpu_count()} cores, "
            f"Python {platform.python_version()}), command `{command}`: {len(self.runs)} runs of "
            f"{WORLD_SIZE} ranks × {self.lines} lines, {self.parallel} jobs at once, {self.hogs} CPU hog(s), "
            f"{self.wall_s / 60:.1f} min.\n\n"
            "| front door | runs | failed | spurious failures | lines lost | median s/run |\n"
            "|---|---|---|---|---|---|\n"
            f"{rows}\n\n"
            f"Processes left behind: {len(self.leftover_processes)}. "
            f"Temp files left behind: {len(self.leftover_temp)}. "
            f"Lines lost: {self.lines_lost} of {len(self.runs) * WORLD_SIZE * self.lines}."
            + (f"\n\nFailures:{failures}" if failures else "")
            + "".join(f"\n- left behind: {what}" for what in self.leftover_processes + self.leftover_temp)
        )


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


class Soak:
    """One soak in ``folder``: writes the notebooks, runs the jobs, checks what is left."""

    def __init__(self, folder: Path, lines: int = 50, timeout: float = 300) -> None:
        self.folder = Path(folder).resolve()
        self.tmp = self.folder / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.lines, self.timeout = lines, timeout
        self.env = {**os.environ, "TMPDIR": str(self.tmp), "NBDDP_STATE_DIR": str(self.folder / "state"),
                    "PYTHONUNBUFFERED": "1", "NBDDP_VIEW": "text"}
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self._write_notebook()

    def _next(self) -> int:
        with self._lock:
            return next(self._counter)

    def _write_notebook(self) -> None:
        cells = [new_code_cell(f"seed = 0\nlines = {self.lines}", metadata={"tags": ["parameters"]}),
                 new_code_cell("#| ddp\n" + SETUP),
                 new_code_cell("#| ddp-train\n" + TRAIN),
                 new_code_cell("print('evaluated', tuple(model.weight.shape))")]
        _write(self.folder / "soak.ipynb", cells)

    # ------------------------------------------------------------------ front doors

    def run_cli(self) -> list[RunCheck]:
        n = self._next()
        run_dir = self.folder / "runs" / f"run-{n:03d}"
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "nbddp", "run", "soak.ipynb", "--cpu", "--nproc", str(WORLD_SIZE),
             "--run-dir", str(run_dir), "-p", "seed", str(n)],
            cwd=self.folder, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", timeout=self.timeout)
        return [self._check("run", run_dir, proc.stdout, time.monotonic() - started, proc.stdout)]

    def run_magic(self, cells: int = RUNS_PER_JOB["magic"]) -> list[RunCheck]:
        from nbclient import NotebookClient

        first = self._next()
        names = [f"magic-{first:03d}-{k}" for k in range(cells)]
        nb_cells = [new_code_cell("%load_ext nbddp"),
                    new_code_cell(f"seed = {first}\nlines = {self.lines}"),
                    new_code_cell("#| ddp\n" + SETUP)]
        nb_cells += [new_code_cell(f"%%ddp_train --cpu --nproc {WORLD_SIZE} --run-dir runs/{name}\n{TRAIN}")
                     for name in names]
        path = _write(self.folder / f"{names[0]}.ipynb", nb_cells)
        nb = nbformat.read(path, as_version=4)
        started = time.monotonic()
        client = NotebookClient(nb, timeout=self.timeout, allow_errors=True, kernel_name="python3",
                                resources={"metadata": {"path": str(self.folder)}})
        with client.setup_kernel(env=self.env):
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
        seconds = (time.monotonic() - started) / cells
        checks = []
        for name, cell in zip(names, nb.cells[3:]):
            text = _cell_text(cell)
            checks.append(self._check("magic", self.folder / "runs" / name, text, seconds, text))
        nbformat.write(nb, path)
        return checks

    def run_batch(self, runs: int = RUNS_PER_JOB["batch"]) -> list[RunCheck]:
        first = self._next()
        out = self.folder / "runs" / f"batch-{first:03d}"
        grid = self.folder / f"grid-{first:03d}.json"
        grid.write_text(json.dumps({"seed": [first * 100 + k for k in range(runs)]}))
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "nbddp", "batch", "soak.ipynb", "--grid", str(grid), "--cpu",
             "--nproc", str(WORLD_SIZE), "--parallel", str(runs), "--out", str(out)],
            cwd=self.folder, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", timeout=self.timeout * runs)
        seconds = (time.monotonic() - started) / runs
        run_dirs = sorted(p for p in out.iterdir() if p.is_dir()) if out.is_dir() else []
        checks = []
        for run_dir in run_dirs:
            executed = run_dir / "output.ipynb"
            text = "".join(_cell_text(c) for c in nbformat.read(executed, 4).cells) if executed.exists() else ""
            checks.append(self._check("batch", run_dir, text, seconds, proc.stdout))
        missing = runs - len(checks)
        checks += [RunCheck("batch", f"{out.name} (missing)", "missing", False, WORLD_SIZE * self.lines, seconds,
                            proc.stdout)] * missing
        return checks

    # ------------------------------------------------------------------ judging

    def _check(self, front: str, run_dir: Path, shown: str, seconds: float, output: str) -> RunCheck:
        try:
            result = json.loads((run_dir / "result.json").read_text())
        except (OSError, ValueError):
            result = {"status": "no result.json", "error": output[-2000:]}
        seen = {(int(r), int(i)) for r, i in _LINE.findall(shown)}
        expected = {(r, i) for r in range(WORLD_SIZE) for i in range(self.lines)}
        done = all((run_dir / "ranks" / f"rank-{r}.done").exists() for r in range(WORLD_SIZE))
        return RunCheck(front, run_dir.name, result["status"], done, len(expected - seen), seconds,
                        result.get("error") or "")

    def leftover_processes(self, grace: float = 10.0) -> list[str]:
        """Processes working in, or started from, the soak folder (other than this one)."""
        import psutil

        me = psutil.Process()
        ours = {me.pid, *(p.pid for p in me.parents())}  # this soak and whatever started it
        deadline = time.monotonic() + grace
        while True:
            found = []
            for proc in psutil.process_iter(["pid", "cwd", "cmdline"]):
                if proc.pid in ours:
                    continue
                cwd, cmdline = proc.info.get("cwd") or "", " ".join(proc.info.get("cmdline") or ())
                if cwd.startswith(str(self.folder)) or str(self.folder) in cmdline:
                    found.append(f"{proc.pid} {cmdline[:200]}")
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def leftover_temp(self) -> list[str]:
        """What the runs left in their temp folder; torch's per-user compile cache is not a leftover.

        (``import torch._dynamo``, done by DDP, creates ``torchinductor_<user>`` once and every torch
        program on the machine reuses it.)
        """
        return sorted(p.name for p in self.tmp.iterdir() if not p.name.startswith("torchinductor_"))


def _write(path: Path, cells: list) -> Path:
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return path


def _cell_text(cell: NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", ()) if o.get("output_type") == "stream")


def _hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)


def soak(folder: Path, runs: int, parallel: int = 2, hogs: int = 1, lines: int = 50,
         fronts: tuple[str, ...] = FRONTS,
         progress: Callable[[list[RunCheck]], None] | None = None) -> SoakReport:
    """Run at least ``runs`` runs, ``parallel`` jobs at once, beside ``hogs`` busy processes."""
    soak_ = Soak(folder, lines)
    jobs, planned = [], 0
    for front in itertools.cycle(fronts):
        if planned >= runs:
            break
        jobs.append(front)
        planned += RUNS_PER_JOB[front]
    started = time.monotonic()
    hog_procs = [_hog() for _ in range(hogs)]
    checks: list[RunCheck] = []
    try:
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            for done in pool.map(lambda front: getattr(soak_, f"run_{'cli' if front == 'run' else front}")(), jobs):
                checks.extend(done)
                if progress:
                    progress(checks)
    finally:
        for hog in hog_procs:
            hog.kill()
            hog.wait()
    return SoakReport(checks, soak_.leftover_processes(), soak_.leftover_temp(), time.monotonic() - started,
                      parallel, hogs, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="runs in all (default 200)")
    parser.add_argument("--parallel", type=int, default=2, help="jobs at once (default 2)")
    parser.add_argument("--hog", type=int, default=1, help="busy processes beside the runs (default 1)")
    parser.add_argument("--lines", type=int, default=50, help="numbered lines per rank (default 50)")
    parser.add_argument("--fronts", default=",".join(FRONTS), help="front doors to use (default: all)")
    parser.add_argument("--folder", type=Path, default=None, help="where the runs go (default: a temp folder)")
    parser.add_argument("--write", type=Path, default=None, help="put the figures into this markdown file")
    args = parser.parse_args(argv)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="nbddp-soak-"))

    def progress(checks: list[RunCheck]) -> None:
        bad = sum(c.status != "succeeded" or c.lines_lost > 0 for c in checks)
        print(f"\r{len(checks)} runs, {bad} bad", end="", file=sys.stderr, flush=True)

    report = soak(folder, args.runs, args.parallel, args.hog, args.lines, tuple(args.fronts.split(",")), progress)
    command = "python -m benchmarks.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report.markdown(command)
    print("\n" + text)
    print(f"\nruns in {folder}")
    if args.write:
        replace_block(args.write, "soak", text)
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
