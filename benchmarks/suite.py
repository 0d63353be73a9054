"""Every speed claim nbddp makes, measured beside its baseline in one run: ``python -m benchmarks.suite``.

Writes BENCHMARKS.md (figures, machine, date, the exact command). ``--quick`` runs each case once,
small and short: CI runs it to check the harness, not the timings. Cases of a figure run
interleaved (round after round), so a slow moment of the machine hits every case alike; figures
are medians with min–max.

1. start → first training step, and start → end: a hand-written torchrun script; ``nbddp run``;
   ``%%ddp_train --fresh``; ``%%ddp_train`` on warm ranks (its 2nd and 10th run).
2. training throughput (steps/s) under ``nbddp run`` against the hand-written script and against nbddp's
   export of the notebook under plain torchrun (which tells the ranks' code from what runs beside them).
3. log streaming: a rank printing timestamped lines at 100 lines/s, then a burst, through
   ``nbddp run`` to the terminal and through ``%%ddp_train``'s live view to an nbclient-executed
   cell: latency print → shown (p50/p99), lines lost, lines/s.
4. returning the model (10M and 100M parameters): nbddp's save on rank 0 + load into the kernel's
   model, against plain ``torch.save`` + ``torch.load``; the loading process's peak memory.
5. ``import nbddp``, ``nbddp --help``, exporting a 200-cell notebook.
6. ``nbddp batch``: each run's time and its ranks' start-up, with ``--fresh`` and on warm ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.document import cpu_name, replace_block

if TYPE_CHECKING:
    from nbformat import NotebookNode

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

SETUP = """#| ddp
import time, torch, nbddp
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
X = torch.randn(2048, 64)
y = torch.randint(0, 10, (2048,))"""
TRAINING = r"""opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
steps, started = 0, time.time()
while steps < __STEPS__:  # a fixed count: ranks deciding by their own clocks could disagree, and hang
    loss = nn.functional.cross_entropy(ddp(X), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if steps == 0:
        print(f"FIRST_STEP {time.time()}\n", end="", flush=True)  # one write: ranks sharing a pipe don't mix lines
    steps += 1
print(f"STEPS_PER_S {steps / (time.time() - started)}\n", end="", flush=True)"""
LOOP = "ddp = nbddp.prepare(model)\n" + TRAINING
#: What a person writes by hand for torchrun: the same model, data and loop.
HAND_WRITTEN = ("import os, time, torch\nimport torch.distributed as dist\nfrom torch import nn\n"
                "from torch.nn.parallel import DistributedDataParallel\n\nif __name__ == '__main__':\n"
                "    dist.init_process_group('gloo')\n"
                + "".join(f"    {line}\n" for line in SETUP.splitlines()[1:] if not line.startswith(("import", "from")))
                + "    ddp = DistributedDataParallel(model)\n"
                + "".join(f"    {line}\n" for line in TRAINING.splitlines())
                + "    if dist.get_rank() == 0:\n        torch.save(model.state_dict(), 'hand.weights.pt')\n"
                + "    dist.destroy_process_group()\n")


#: How the hand-written script is launched: torchrun, 2 processes on this machine.
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def write_training(work: Path, script: str, notebook_name: str, steps: int) -> str:
    """The same training for ``steps`` steps, twice: the hand-written ``script`` and the notebook
    ``notebook_name`` (its setup cell and its training cell); returns the training cell's loop."""
    loop = LOOP.replace("__STEPS__", str(steps))
    (work / script).write_text(HAND_WRITTEN.replace("__STEPS__", str(steps)))
    notebook(work / notebook_name, [(SETUP, []), ("#| ddp-train\n" + loop, [])])
    return loop


def summary(values: list[float], unit: str = "s", digits: int = 2) -> str:
    if not values:
        return "n/a"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f} {unit}"
    return f"{med:.{digits}f} {unit} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def notebook(path: Path, cells: list[tuple[str, list[str]]]) -> Path:
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[new_code_cell(src, metadata={"tags": tags} if tags else {}) for src, tags in cells],
                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, path)
    return path


def first_step(text: str) -> float | None:
    found = re.findall(r"FIRST_STEP ([\d.]+)", text)
    return min(float(t) for t in found) if found else None


def steps_per_s(text: str) -> float | None:
    found = [float(v) for v in re.findall(r"STEPS_PER_S ([\d.]+)", text)]
    return statistics.mean(found) if found else None


# ---------------------------------------------------------------- 1 and 2: starting and training


#: Hand-written runs that died at their end with "terminate called without an active exception": the
#: gloo teardown race (a barrier's work freed by a gloo thread at interpreter exit) nbddp guards against.
TEARDOWN_CRASHES: list[str] = []


def run_process(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[float, float | None, str]:
    """(seconds to end, seconds to the first step, output) of a command.

    A hand-written run that crashes in the gloo teardown race after training is counted and run
    again: the race is the script's, and the comparison is about speed.
    """
    for _ in range(3):
        start = time.time()
        done = subprocess.run(argv, cwd=cwd, env=env or ENV, capture_output=True, text=True)
        end = time.time()
        out = done.stdout + done.stderr
        if done.returncode and "terminate called without an active exception" in out and "nbddp" not in argv[2]:
            TEARDOWN_CRASHES.append(" ".join(argv[-1:]))
            continue
        break
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out[-3000:]}")
    first = first_step(out + "".join(p.read_text() for p in cwd.glob("runs/*/logs/rank-*.log")))
    for folder in cwd.glob("runs"):
        shutil.rmtree(folder)
    return end - start, (first - start) if first else None, out


class Kernel:
    """A real ipykernel driven with execute requests, as a front end does."""

    def __init__(self, cwd: Path) -> None:
        from jupyter_client import KernelManager

        self.cwd = cwd
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(cwd), env=ENV)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def execute(self, code: str) -> tuple[float, str]:
        start = time.time()
        msg_id = self.kc.execute(code)
        out = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=300)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            content = msg["content"]
            if msg["msg_type"] == "stream":
                out.append(content["text"])
            elif msg["msg_type"] == "error":
                raise SystemExit("\n".join(content["traceback"]))
            elif msg["msg_type"] == "status" and content["execution_state"] == "idle":
                return time.time() - start, "".join(out)

    def train(self, cell: str) -> tuple[float, float | None]:
        start = time.time()
        seconds, out = self.execute(cell)
        logs = sorted(self.cwd.glob("runs/*"), key=lambda p: p.stat().st_mtime)[-1]
        first = first_step("".join(p.read_text() for p in (logs / "logs").glob("rank-*.log")))
        return seconds, (first - start) if first else None

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def startup(work: Path, rounds: int, steps: int, before: tuple[str, Path] | None = None) -> dict[str, dict[str, list[float]]]:
    """``before``: ``(ref, checkout)`` of an earlier nbddp, whose ``nbddp run`` is timed in the same rounds."""
    loop = write_training(work, "hand.py", "bench.ipynb", steps)
    cases = ["torchrun by hand", "nbddp run", "%%ddp_train --fresh", "%%ddp_train, 1st run (warm ranks forked from the starter %load_ext started)",
             "%%ddp_train warm, 2nd run", "%%ddp_train warm, 10th run"]
    if before is not None:
        cases.insert(2, f"nbddp run before ({before[0]})")
    times: dict[str, dict[str, list[float]]] = {c: {"end": [], "first": []} for c in cases}

    def add(case: str, end: float, first: float | None) -> None:
        times[case]["end"].append(end)
        if first is not None:
            times[case]["first"].append(first)

    for _ in range(rounds):
        add("torchrun by hand", *run_process(TORCHRUN + ["hand.py"], work)[:2])
        add("nbddp run", *run_process([PYTHON, "-m", "nbddp", "run", "bench.ipynb", "--cpu", "--nproc", "2"], work)[:2])
        if before is not None:
            ref, checkout = before
            module = "nbddp" if (checkout / "nbddp" / "__main__.py").exists() else "nbddp.cli"
            add(f"nbddp run before ({ref})", *run_process(
                [PYTHON, "-m", module, "run", "bench.ipynb", "--cpu", "--nproc", "2"], work,
                env={**ENV, "PYTHONPATH": str(checkout)})[:2])
        kernel = Kernel(work)
        try:
            kernel.execute("%load_ext nbddp")
            kernel.execute(SETUP)
            add("%%ddp_train --fresh", *kernel.train(f"%%ddp_train --fresh --cpu --nproc 2\n{loop}"))
            for run in range(1, 11):
                result = kernel.train(f"%%ddp_train --cpu --nproc 2\n{loop}")
                if run == 1:
                    add("%%ddp_train, 1st run (warm ranks forked from the starter %load_ext started)", *result)
                if run in (2, 10):
                    add(f"%%ddp_train warm, {run}{'nd' if run == 2 else 'th'} run", *result)
        finally:
            kernel.close()
        shutil.rmtree(work / "runs", ignore_errors=True)
    return times


#: Section 2's cases: the hand-written script; nbddp's export of the notebook under plain torchrun (nbddp's
#: runtime in the ranks, nothing else of nbddp); ``nbddp run`` (the kernel and the front end beside the ranks).
THROUGHPUT_CASES = ("torchrun by hand", "exported script under torchrun", "nbddp run")


def throughput(work: Path, rounds: int, steps: int) -> dict[str, list[float]]:
    """Steps/s in the ranks of each of :data:`THROUGHPUT_CASES`, interleaved round after round; also the CPU
    seconds each case's processes used (``"<case> cpu"``): what a case adds beside the ranks shows there."""
    write_training(work, "hand_long.py", "long.ipynb", steps)
    subprocess.run([PYTHON, "-m", "nbddp", "export", "long.ipynb", "-o", "exported_long.py"], cwd=work, env=ENV,
                   capture_output=True, text=True, check=True)
    rates: dict[str, list[float]] = {key: [] for case in THROUGHPUT_CASES for key in (case, f"{case} cpu")}
    for _ in range(rounds):
        for case in THROUGHPUT_CASES:
            before = os.times()
            if case == "nbddp run":
                subprocess.run([PYTHON, "-m", "nbddp", "run", "long.ipynb", "--cpu", "--nproc", "2"], cwd=work,
                               env=ENV, capture_output=True, text=True, check=True)
                [run] = list(work.glob("runs/long-*"))
                rate = steps_per_s("".join(p.read_text() for p in (run / "logs").glob("rank-*.log")))
                shutil.rmtree(work / "runs")
            else:
                rate = steps_per_s(run_process(TORCHRUN + ["hand_long.py" if case == "torchrun by hand"
                                                           else "exported_long.py"], work)[2])
            after = os.times()
            rates[case].append(rate)
            rates[f"{case} cpu"].append(after.children_user + after.children_system
                                        - before.children_user - before.children_system)
    return rates


def throughput_lines(rates: dict[str, list[float]], pointer: bool = True) -> list[str]:
    """Section 2's table and ratios (shared with :mod:`benchmarks.throughput`, which runs more rounds);
    ``pointer``: say where more rounds are."""
    median = {case: statistics.median(rates[case]) for case in THROUGHPUT_CASES}
    hand, exported, nbddp = (median[case] for case in THROUGHPUT_CASES)
    paired = [n / h for h, n in zip(rates["torchrun by hand"], rates["nbddp run"])]
    lines = ["| case | steps/s | CPU seconds, all its processes |", "|---|---|---|"]
    lines += [f"| {case} | {summary(rates[case], 'steps/s', 1)} | {summary(rates[f'{case} cpu'], 's', 1)} |"
              for case in THROUGHPUT_CASES]
    return lines + ["", f"Ratio nbddp / by hand: **{nbddp / hand:.3f}** (medians; round by round "
                        f"{statistics.median(paired):.3f}, {min(paired):.3f}–{max(paired):.3f}); the exported script under torchrun / by hand: "
                        f"{exported / hand:.3f}; `nbddp run` / the exported script: {nbddp / exported:.3f} (what "
                        "the kernel and the front end beside the ranks cost)." + (
                            " Two rounds on a shared machine move these by several percent: `python -m "
                            "benchmarks.throughput` runs more rounds and measures where the CPU goes (section 11)."
                            if pointer else "")]


# ---------------------------------------------------------------- 3: log streaming


def streaming(work: Path, paced: int, burst: int) -> dict[str, float]:
    """Lines printed by rank 0 with their time; the harness stamps each as it reaches the terminal."""
    code = (f"#| ddp-train\nimport time, nbddp\nif nbddp.rank() == 0:\n"
            f"    for i in range({paced}):\n        print('LINE', i, time.time(), flush=True)\n        time.sleep(0.01)\n"
            f"    time.sleep(0.5)\n"  # the paced lines are all shown before the burst begins
            f"    for i in range({paced}, {paced + burst}):\n        print('LINE', i, time.time())\n"
            f"    print('BURST_DONE', time.time(), flush=True)\n")
    notebook(work / "logs.ipynb", [("#| ddp\nimport nbddp", []), (code, [])])
    proc = subprocess.Popen([PYTHON, "-m", "nbddp", "run", "logs.ipynb", "--cpu", "--nproc", "2"], cwd=work,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    seen: dict[int, tuple[float, float]] = {}
    for line in proc.stdout:
        now = time.time()
        match = re.match(r"\[rank 0\] LINE (\d+) ([\d.]+)", line)
        if match:
            seen[int(match.group(1))] = (float(match.group(2)), now)
    proc.wait()
    shutil.rmtree(work / "runs", ignore_errors=True)
    return _latency(seen, paced, burst)


def streaming_notebook(work: Path, paced: int, burst: int) -> dict[str, float]:
    """The same lines from a ``%%ddp_train`` cell executed by nbclient; each stamped as its message arrives.

    The live view's lines reach the front end as widget messages (a chunk of lines per refresh);
    the harness reads them where nbclient receives them, as JupyterLab would. A chunk shows at most
    its last 400 lines under a count of those skipped, so a burst is mostly counted, not shown; the
    run dir's log must still hold every line.
    """
    import nbformat
    from nbclient import NotebookClient

    code = (f"%%ddp_train --cpu --nproc 2\nimport time, nbddp\nif nbddp.rank() == 0:\n"
            f"    for i in range({paced}):\n        print('LINE', i, time.time(), flush=True)\n        time.sleep(0.01)\n"
            f"    time.sleep(0.5)\n    print('BURST_START', time.time(), flush=True)\n"
            f"    for i in range({paced}, {paced + burst}):\n        print('LINE', i, time.time())\n"
            f"    print('BURST_DONE', time.time(), flush=True)\n")
    path = notebook(work / "cell_logs.ipynb", [("%load_ext nbddp", []), ("#| ddp\nmodel = None", []), (code, [])])
    seen: dict[int, tuple[float, float]] = {}
    marks: dict[str, float] = {}
    skipped = [0]

    class Stamping(NotebookClient):
        def process_message(self, msg: dict[str, Any], cell: NotebookNode, cell_index: int) -> NotebookNode | None:
            now = time.time()
            if msg["msg_type"] in ("comm_open", "comm_msg"):
                value = msg["content"].get("data", {}).get("state", {}).get("value")
                if isinstance(value, str) and "[rank 0] " in value:  # the all-ranks pane
                    for i, stamp in re.findall(r"\[rank 0\] LINE (\d+) ([\d.]+)", value):
                        seen.setdefault(int(i), (float(stamp), now))
                    for word in ("BURST_START", "BURST_DONE"):
                        if f"[rank 0] {word}" in value:
                            marks.setdefault(word, now)
                    skipped[0] += sum(int(n.replace(",", "")) for n in re.findall(r"… ([\d,]+) lines skipped", value))
            return super().process_message(msg, cell, cell_index)

    nb = nbformat.read(path, as_version=4)
    Stamping(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(work)}}).execute()
    [log] = work.glob("runs/*/logs/rank-0.log")
    text = log.read_text()
    logged = text.count("LINE ")
    burst_start = float(re.search(r"BURST_START ([\d.]+)", text).group(1))  # its line is likely skipped in the view
    shutil.rmtree(work / "runs", ignore_errors=True)
    found = _latency(seen, paced, 0)
    shown = sum(1 for i in seen if i >= paced)
    return {**found, "lines": paced + burst, "burst_shown": shown, "burst_skipped": skipped[0],
            "lost": paced + burst + 2 - len(seen) - len(marks) - skipped[0], "logged": logged,
            "burst_lines_per_s": burst / max(marks["BURST_DONE"] - burst_start, 1e-9)}


def _latency(seen: dict[int, tuple[float, float]], paced: int, burst: int) -> dict[str, float]:
    """Percentiles of print → seen over the paced lines; the burst's lines seen per second."""
    paced_latency = sorted(seen[i][1] - seen[i][0] for i in range(paced) if i in seen)
    burst_seen = sorted((seen[i] for i in range(paced, paced + burst) if i in seen), key=lambda s: s[1])
    first_print = min((s[0] for s in burst_seen), default=0.0)
    rate = len(burst_seen) / max(burst_seen[-1][1] - first_print, 1e-9) if burst_seen else 0.0

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    first = seen.get(0)
    return {"first_ms": 1000 * (first[1] - first[0]) if first else float("nan"),
            "p50_ms": 1000 * pct(paced_latency, 0.5), "p99_ms": 1000 * pct(paced_latency, 0.99),
            "lost": paced + burst - len(seen),
            "burst_lines_per_s": rate, "lines": paced + burst}


# ---------------------------------------------------------------- 4: returning the model

RETURN = """
import resource, sys, time, torch
from torch import nn
from nbddp.contracts import checkpoint
params, how, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
width = int((params / 4) ** 0.5)
make = lambda: nn.Sequential(nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width))
if sys.argv[4] == "save":
    torch.manual_seed(0)
    model = make()
    start = time.perf_counter()
    if how == "nbddp":
        checkpoint.save_returns({"model": model}, path)
    else:
        torch.save(model.state_dict(), path)
    print(time.perf_counter() - start)
else:
    model = make()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if how == "nbddp":
        states, _ = checkpoint.load_returns(path)
        checkpoint.load_into({"model": model}, states)
    else:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    took = time.perf_counter() - start
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    print(took, peak, sum(p.numel() * p.element_size() for p in model.parameters()))
"""


def model_return(work: Path, rounds: int, sizes: list[int]) -> dict[int, dict[str, list[float]]]:
    script = work / "ret.py"
    script.write_text(RETURN)
    found: dict[int, dict[str, list[float]]] = {}
    for params in sizes:
        found[params] = {"nbddp": [], "plain": [], "nbddp_peak": [], "plain_peak": [], "bytes": []}
        for _ in range(rounds):
            for how in ("nbddp", "plain"):
                path = work / f"w-{how}.pt"
                saved = float(subprocess.run([PYTHON, str(script), str(params), how, str(path), "save"], env=ENV,
                                             capture_output=True, text=True, check=True).stdout.split()[-1])
                took, peak, size = (float(v) for v in subprocess.run(
                    [PYTHON, str(script), str(params), how, str(path), "load"], env=ENV, capture_output=True,
                    text=True, check=True).stdout.split()[-3:])
                found[params][how].append(saved + took)
                found[params][f"{how}_peak"].append(peak / size)
                found[params]["bytes"] = [size]
                path.unlink()
    return found


# ---------------------------------------------------------------- 5: the light paths


def light_paths(work: Path, rounds: int) -> dict[str, list[float]]:
    cells = [("#| ddp\nimport torch\nx = 1", [])] + [(f"#| ddp\nvalue_{i} = {i} * 2\nprint(value_{i})", [])
                                                   for i in range(198)] + [("#| ddp-train\nprint(x)", [])]
    notebook(work / "big.ipynb", cells)
    cases = {"import nbddp": [PYTHON, "-c", "import nbddp, sys; assert 'torch' not in sys.modules"],
             "nbddp --help": [PYTHON, "-m", "nbddp", "--help"],
             "nbddp export (200 cells)": [PYTHON, "-m", "nbddp", "export", "big.ipynb", "-o", "big.py"]}
    found: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(rounds):
        for case, argv in cases.items():
            start = time.perf_counter()
            subprocess.run(argv, cwd=work, env=ENV, capture_output=True, check=True)
            found[case].append(time.perf_counter() - start)
    return found


# ---------------------------------------------------------------- 6: warm ranks in a batch


def batch_startup(work: Path, rounds: int, runs: int, steps: int) -> dict[str, dict[str, list[float]]]:
    """``nbddp batch`` of the start-up notebook with a ``parameters`` cell, one run at a time, with
    ``--fresh`` (every run starts its ranks) and on the slot's warm ranks (the default), interleaved.

    A run's rank start-up is the time from its script being written (just before its ranks are
    started, or handed the job) to its first training step.
    """
    loop = LOOP.replace("__STEPS__", str(steps)).replace("lr=0.05", "lr=lr")
    notebook(work / "sweep.ipynb", [("lr = 0.05", ["parameters"]), (SETUP, []), ("#| ddp-train\n" + loop, [])])
    (work / "grid.json").write_text(json.dumps({"lr": [0.01 * (i + 1) for i in range(runs)]}))
    found = {case: {"per run": [], "first": [], "later": []} for case in ("--fresh", "warm ranks")}
    for _ in range(rounds):
        for case, extra in (("--fresh", ["--fresh"]), ("warm ranks", [])):
            start = time.time()
            subprocess.run([PYTHON, "-m", "nbddp", "batch", "sweep.ipynb", "--grid", "grid.json", "--cpu", "--nproc",
                            "2", "--parallel", "1", "--out", "sweep", *extra], cwd=work, env=ENV, capture_output=True,
                           text=True, check=True)
            found[case]["per run"].append((time.time() - start) / runs)
            for index, run_dir in enumerate(sorted((work / "sweep").glob("0*"))):
                first = first_step("".join(p.read_text() for p in (run_dir / "logs").glob("rank-*.log")))
                found[case]["later" if index else "first"].append(first - (run_dir / "train.py").stat().st_mtime)
            shutil.rmtree(work / "sweep")
    return found


# ---------------------------------------------------------------- the report


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} cores ({cpu_name()}), {gpu}, Python {platform.python_version()}, torch {torch.__version__}, "
            f"{platform.system()} {platform.release()}")


def report(args: argparse.Namespace, figures: dict) -> str:
    start, rates, logs, cell, ret, light, sweep = (figures[k] for k in (
        "startup", "throughput", "streaming", "cell streaming", "return", "light", "batch"))
    hand_end = statistics.median(start["torchrun by hand"]["end"])
    lines = [
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {machine()}.", "",
        f"Command: `python -m benchmarks.suite {' '.join(args.argv)}`".rstrip() + ". Every figure is a median, "
        "with min–max, of cases run interleaved in the same rounds.", "",
        f"## 1. Start → first training step, start → end ({args.startup_rounds} rounds, 2 gloo ranks, {args.steps} steps)", "",
        "| case | to first step | to end | end vs torchrun by hand |", "|---|---|---|---|"]
    for case, values in start.items():
        ratio = statistics.median(values["end"]) / hand_end
        lines.append(f"| {case} | {summary(values['first'])} | {summary(values['end'])} | {ratio:.2f}× |")
    lines += ["", "The torchrun and `nbddp run` times start at the command; the `%%ddp_train` times at the cell's "
              "execute request (its kernel already running, as in a notebook). `nbddp run` includes its kernel "
              "(setup and other cells) beside the job. The 1st warm run follows the `--fresh` one, its starter having "
              "had that run's time to import torch; a first run in a fresh kernel right after its setup cells is "
              "section 7's \"The first run in a fresh kernel\".", "",
              f"## 2. Training throughput ({args.long_steps} steps per job, {1 if args.quick else 2} rounds)", "",
              *throughput_lines(rates), "",
              f"## 3. Log streaming ({logs['lines']} lines from rank 0: {args.paced} paced at 100 lines/s, then a burst)", "",
              "| where | first line | paced: latency p50 | p99 | lines not shown | burst: lines/s |",
              "|---|---|---|---|---|---|",
              f"| terminal (`nbddp run`) | {logs['first_ms']:.0f} ms | {logs['p50_ms']:.0f} ms | {logs['p99_ms']:.0f} ms | "
              f"{logs['lost']} | {logs['burst_lines_per_s']:.0f} |",
              f"| nbclient cell (`%%ddp_train`, live view) | {cell['first_ms']:.0f} ms | {cell['p50_ms']:.0f} ms | "
              f"{cell['p99_ms']:.0f} ms | {cell['lost']} | {cell['burst_lines_per_s']:.0f} |",
              "", "Latency is from the rank's `print` (its timestamp in the line) to the line read from `nbddp run`'s "
              "stdout, or to the widget message carrying it reaching nbclient (where JupyterLab would draw it). The live "
              "view shows lines at once, up to 4 updates in a row; while lines keep coming it sends them in chunks, "
              "4 a second, which is most of the paced lines' latency. A chunk shows at most its "
              f"last 400 lines under a count of those skipped: of the burst, the view showed {cell['burst_shown']} lines "
              f"and counted {cell['burst_skipped']} as skipped. Under a flood the follower reads at most 256 kB of a rank's "
              "log per look (a Stop under a flood still ends in seconds) and says how much it passed over (\"… N of "
              "output not shown here\", naming the log): \"not shown\" is every line neither shown nor counted, and "
              f"the run dir's log held {cell['logged']} of the {cell['lines']} lines. Burst lines/s: the burst's length "
              "over the time from its first print to its last line shown.", "",
              f"## 4. Returning the model ({args.rounds} rounds)", "",
              "| parameters | nbddp save + load into the model | plain torch.save + torch.load | ratio | "
              "loader's peak memory / model size: nbddp | plain |", "|---|---|---|---|---|---|"]
    for params, values in ret.items():
        ratio = statistics.median(values["nbddp"]) / statistics.median(values["plain"])
        lines.append(f"| {params / 1e6:.0f}M | {summary(values['nbddp'])} | {summary(values['plain'])} | {ratio:.2f}× | "
                     f"{summary(values['nbddp_peak'], '×')} | {summary(values['plain_peak'], '×')} |")
    lines += ["", "Peak memory is the growth of the loading process's maximum resident set while loading, divided by "
              "the model's size in bytes (the model itself already exists before loading).", "",
              f"## 5. The light paths ({args.rounds} rounds)", "", "| case | time |", "|---|---|"]
    lines += [f"| {case} | {summary(values, 's', 3)} |" for case, values in light.items()]
    fresh_run, warm_run = (statistics.median(sweep[c]["per run"]) for c in ("--fresh", "warm ranks"))
    lines += ["", f"## 6. `nbddp batch` on warm ranks ({args.batch_rounds} round(s) of {args.batch_runs} runs of section 1's "
              "notebook with a `parameters` cell, one at a time)", "",
              "| case | per run (the whole `nbddp run`) | rank start-up (script written → first step): the batch's "
              "1st run | its later runs |", "|---|---|---|---|"]
    lines += [f"| {case} | {summary(values['per run'])} | {summary(values['first'])} | {summary(values['later'])} |"
              for case, values in sweep.items()]
    lines += ["", f"A batch's runs on one device slot share its warm ranks by default: {warm_run:.2f} s per run against "
              f"{fresh_run:.2f} s ({warm_run / fresh_run:.2f}×) for this trivial run. The saving, about "
              f"{fresh_run - warm_run:.1f} s a run, is fixed: a run that trains for 10 minutes gains "
              f"{100 * (fresh_run - warm_run) / (fresh_run + 600):.1f}%. Each run still has its own `nbddp run` process, "
              "kernel and run dir; `--fresh` gives each its own ranks too."]
    if TEARDOWN_CRASHES:
        lines += ["", f"The hand-written script crashed {len(TEARDOWN_CRASHES)} time(s) after training with "
                  "\"terminate called without an active exception\" (SIGABRT): gloo's teardown race at "
                  "`destroy_process_group`, which nbddp's ranks guard against (docs/reliability.md). Those runs were "
                  "repeated; their times are not in the figures."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each case once, small and short: checks the harness")
    parser.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    parser.add_argument("--before", metavar="GIT_REF", default=None,
                        help="also time `nbddp run` of this earlier commit (a temporary checkout) in section 1")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.rounds = 1 if args.quick else 3
    args.startup_rounds = 1 if args.quick else 5  # start-up times vary most on a shared machine
    args.steps = 5 if args.quick else 20
    args.long_steps = 300 if args.quick else 8000  # ~2 s and ~60 s at this machine's ~140 steps/s
    args.paced, args.burst = (100, 2000) if args.quick else (1000, 100_000)
    args.batch_rounds, args.batch_runs = (1, 2) if args.quick else (2, 4)
    work = Path(tempfile.mkdtemp(prefix="nbddp-bench-"))
    ENV["TMPDIR"] = str(work)  # torchrun by hand leaves its torchelastic_* folder there, not in /tmp
    before = None
    if args.before:
        checkout = work / "before"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(checkout), args.before],
                       check=True, capture_output=True)
        before = (args.before, checkout)
    try:
        figures = {
            "light": light_paths(work, args.rounds),
            "startup": startup(work, args.startup_rounds, args.steps, before),
            "throughput": throughput(work, 1 if args.quick else 2, args.long_steps),
            "streaming": streaming(work, args.paced, args.burst),
            "cell streaming": streaming_notebook(work, args.paced, args.burst),
            "batch": batch_startup(work, args.batch_rounds, args.batch_runs, args.steps),
            "return": model_return(work, args.rounds if args.quick else 3, [1_000_000] if args.quick else [10_000_000, 100_000_000]),
        }
    finally:
        if before is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before[1])], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    if not args.out.exists():
        args.out.write_text("# Benchmarks\n")
    replace_block(args.out, "suite", report(args, figures))  # (python -m benchmarks.peers writes its own block)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
