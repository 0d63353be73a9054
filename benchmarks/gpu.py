"""nbddp on a GPU: ``python -m benchmarks.gpu [--quick] [--out BENCHMARKS.md]``, on a machine with one GPU or more.

Four questions, each answered by real runs on the machine's first GPU (one rank: one GPU is what a session
here can borrow), every case interleaved with its baseline in the same rounds:

1. **training throughput** of ``nbddp run --gpus 1`` against the same script written by hand for torchrun
   (goal: ≥ 0.99);
2. **first and warm runs** of a ``%%ddp_train`` cell in a kernel (the first starts the warm rank);
3. **torch.compile**: the same cell compiling its model, first run against warm re-runs (the rank keeps
   the compiled code);
4. **sharded memory**: the peak CUDA memory a rank reports (``result.json``'s ``peak_memory``) for a
   ~400M-parameter model trained with Adam, as DDP, with ``--shard``, and with ``--shard`` and
   ``offload=True``, and that the weights come back whole on the CPU.

``--device cpu`` runs the same harness on gloo CPU ranks (small sizes): it checks the harness on a machine
without a GPU, and its figures say nothing about GPUs. The block it writes is headed with the machine's GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.document import replace_block
from benchmarks.suite import ENV, PYTHON, REPO, Kernel, machine, notebook, steps_per_s, summary

#: One rank's work: a deep MLP in bfloat16 autocast on the GPU (float32 on CPU ranks), fixed data.
SETUP = """#| ddp
import json, time, torch, nbddp
from torch import nn
torch.manual_seed(0)
WIDTH, DEPTH, BATCH = __WIDTH__, __DEPTH__, __BATCH__
model = nn.Sequential(*[layer for _ in range(DEPTH) for layer in (nn.Linear(WIDTH, WIDTH), nn.GELU())],
                      nn.Linear(WIDTH, 10))
X = torch.randn(BATCH, WIDTH)
y = torch.randint(0, 10, (BATCH,))"""
TRAINING = r"""device = __DEVICE__
X_, y_ = X.to(device), y.to(device)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
def step():
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = nn.functional.cross_entropy(ddp(X_), y_)
    opt.zero_grad(); loss.backward(); opt.step()
for _ in range(5):
    step()  # warm-up: allocations, cuBLAS heuristics, (compilation)
if device.type == "cuda":
    torch.cuda.synchronize()
steps, started = 0, time.time()
while steps < __STEPS__:
    step(); steps += 1
if device.type == "cuda":
    torch.cuda.synchronize()
print(f"STEPS_PER_S {steps / (time.time() - started)}\n", end="", flush=True)"""
#: The same, written by hand for torchrun: what a person would run instead.
HAND_WRITTEN = """import os, time, torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if __name__ == '__main__':
    local = int(os.environ["LOCAL_RANK"])
    cuda = __CUDA__
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
__SETUP__
    model = model.to(torch.device("cuda", local) if cuda else torch.device("cpu"))
    ddp = DistributedDataParallel(model, device_ids=[local] if cuda else None)
__TRAINING__
    dist.destroy_process_group()
"""
#: A sharded run's cell: ``prepare`` with the run's ``--shard`` and the offload it is given; the peak memory
#: is the rank's own report (result.json), the weights' size checked in the kernel.
SHARD_TRAINING = """#| ddp-train
ddp = nbddp.prepare(model, mixed_precision=torch.bfloat16, offload=__OFFLOAD__)
opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
device = nbddp.device()
for _ in range(3):
    loss = ddp(torch.randn(BATCH, WIDTH, device=device)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()"""
PARAMETERS = "print('PARAMETERS', sum(p.numel() for p in model.parameters()))"


def indented(code: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line else line for line in code.splitlines())


def setup_code(sizes: dict) -> str:
    code = SETUP
    for key, value in sizes.items():
        code = code.replace(f"__{key.upper()}__", str(value))
    return code


def run(argv: list[str], cwd: Path) -> str:
    done = subprocess.run(argv, cwd=cwd, env=ENV, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr


def latest_run(work: Path) -> Path:
    return max(work.glob("runs/*"), key=lambda p: p.stat().st_mtime)


def throughput(work: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """(1) steps/s in the rank: nbddp run against the hand-written script, rounds interleaved."""
    device = "nbddp.device()"
    loop = TRAINING.replace("__STEPS__", str(args.steps)).replace("__DEVICE__", device)
    notebook(work / "fit.ipynb", [(setup_code(args.sizes), []), ("#| ddp-train\nddp = nbddp.prepare(model)\n" + loop, [])])
    hand = (HAND_WRITTEN.replace("__CUDA__", str(args.cuda))
            .replace("__SETUP__", indented("\n".join(line for line in setup_code(args.sizes).splitlines()[1:]
                                                      if not line.startswith(("import", "from")))))
            .replace("__TRAINING__", indented(TRAINING.replace("__STEPS__", str(args.steps)).replace(
                "__DEVICE__", "next(model.parameters()).device"))))
    (work / "hand.py").write_text(hand)
    rates: dict[str, list[float]] = {"torchrun by hand": [], "nbddp run": []}
    for _ in range(args.rounds):
        out = run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "hand.py"], work)
        rates["torchrun by hand"].append(steps_per_s(out))
        run([PYTHON, "-m", "nbddp", "run", "fit.ipynb", *args.devices], work)
        rates["nbddp run"].append(steps_per_s("".join(p.read_text() for p in (latest_run(work) / "logs").glob("rank-*.log"))))
        shutil.rmtree(work / "runs")
    return rates


def kernel_runs(work: Path, args: argparse.Namespace, compiled: bool) -> list[float]:
    """(2, 3) the wall time of 3 runs of one ``%%ddp_train`` cell in one kernel: the first starts the warm rank."""
    steps = max(args.steps // 10, 5)
    loop = TRAINING.replace("__STEPS__", str(steps)).replace("__DEVICE__", "nbddp.device()")
    prepare = "ddp = torch.compile(nbddp.prepare(model))\n" if compiled else "ddp = nbddp.prepare(model)\n"
    kernel = Kernel(work)
    try:
        kernel.execute("%load_ext nbddp")
        kernel.execute(setup_code(args.sizes))
        walls = []
        for _ in range(3):
            seconds, out = kernel.execute(f"%%ddp_train {' '.join(args.devices)}\n{prepare}{loop}")
            result = json.loads((latest_run(work) / "result.json").read_text())
            if result["status"] != "succeeded":
                raise SystemExit(f"the %%ddp_train run failed: {result.get('error')}\n{out[-3000:]}")
            walls.append(seconds)
        return walls
    finally:
        kernel.close()
        shutil.rmtree(work / "runs", ignore_errors=True)


def sharded_memory(work: Path, args: argparse.Namespace) -> dict[str, dict]:
    """(4) each way's peak memory (rank 0's report) and the parameters that came back into the kernel."""
    setup = setup_code(args.shard_sizes)
    cases = {"DDP": ([], "False"), "--shard": (["--shard"], "False"), "--shard, offload=True": (["--shard"], "True")}
    figures: dict[str, dict] = {}
    for case, (flags, offload) in cases.items():
        notebook(work / "big.ipynb", [(setup, []), (SHARD_TRAINING.replace("__OFFLOAD__", offload), []),
                                      (PARAMETERS, [])])
        started = time.time()
        out = run([PYTHON, "-m", "nbddp", "run", "big.ipynb", *args.devices, *flags], work)
        result = json.loads((latest_run(work) / "result.json").read_text())
        figures[case] = {"peak": int(result["peak_memory"]["0"]), "seconds": time.time() - started,
                         "parameters": int(re.search(r"PARAMETERS (\d+)", out).group(1))}
        shutil.rmtree(work / "runs")
    return figures


def report(args: argparse.Namespace, figures: dict) -> str:
    rates, first_warm, compiled, memory = (figures[k] for k in ("throughput", "warm", "compile", "memory"))
    ratio = statistics.median(rates["nbddp run"]) / statistics.median(rates["torchrun by hand"])
    where = "one GPU" if args.cuda else "one CPU rank (gloo): a check of the harness, not a GPU figure"
    lines = [f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {machine()}, on {where}.", "",
             f"Command: `python -m benchmarks.gpu {' '.join(args.argv)}`".rstrip() + ". Medians with min–max; each case "
             "interleaved with its baseline.", "",
             f"### 1. Training throughput ({args.sizes['depth']} × Linear({args.sizes['width']}), batch "
             f"{args.sizes['batch']}, {'bfloat16 autocast, ' if args.cuda else ''}AdamW, {args.steps} steps after 5 warm-up "
             f"steps, {args.rounds} rounds)", "",
             "| case | steps/s in the rank |", "|---|---|",
             f"| torchrun by hand | {summary(rates['torchrun by hand'], 'steps/s', 1)} |",
             f"| nbddp run | {summary(rates['nbddp run'], 'steps/s', 1)} |", "",
             f"Ratio nbddp / by hand: **{ratio:.3f}** (goal ≥ 0.99).", "",
             "### 2. `%%ddp_train` in one kernel: first run (starts the warm rank), then warm runs", "",
             "| | 1st run | 2nd | 3rd |", "|---|---|---|---|",
             "| plain | " + " | ".join(f"{s:.2f} s" for s in first_warm) + " |",
             "| `torch.compile(nbddp.prepare(model))` | " + " | ".join(f"{s:.2f} s" for s in compiled) + " |", "",
             "A warm rank keeps what the process made: the compiled code too, so the re-runs don't compile again.", "",
             f"### 3. Sharded memory ({args.shard_sizes['depth']} × Linear({args.shard_sizes['width']}), Adam, bfloat16 "
             "mixed precision, 3 steps)", "",
             "| case | peak memory of rank 0 | run (s) | parameters back in the kernel |", "|---|---|---|---|"]
    for case, values in memory.items():
        lines.append(f"| {case} | {values['peak'] / 1e9:.2f} GB | {values['seconds']:.1f} | "
                     f"{values['parameters'] / 1e6:.0f}M |")
    lines += ["", "Peak memory is the rank's own report (`result.json`'s `peak_memory`: CUDA's peak allocated memory on "
              "a GPU rank, the resident set on a CPU rank)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small and short: checks the harness")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                        help="cpu: the same harness on one gloo CPU rank (a check, not a GPU figure)")
    parser.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.cuda = args.device == "gpu"
    if args.cuda:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no GPU visible: run this on a GPU machine, or check the harness with --device cpu --quick")
    small = args.quick or not args.cuda
    args.devices = ["--gpus", "1"] if args.cuda else ["--cpu", "--nproc", "1"]
    args.sizes = ({"width": 256, "depth": 2, "batch": 64} if small else {"width": 4096, "depth": 8, "batch": 512})
    args.shard_sizes = ({"width": 512, "depth": 4, "batch": 8} if small else {"width": 8192, "depth": 6, "batch": 8})
    args.steps = 40 if small else 400
    args.rounds = 1 if args.quick else 3
    work = Path(tempfile.mkdtemp(prefix="nbddp-gpu-"))
    ENV["TMPDIR"] = str(work)
    try:
        figures: dict = {}
        for name, measure in (("throughput", lambda: throughput(work, args)),
                              ("warm", lambda: kernel_runs(work, args, compiled=False)),
                              ("compile", lambda: kernel_runs(work, args, compiled=True)),
                              ("memory", lambda: sharded_memory(work, args))):
            figures[name] = measure()
            print(f"{name}: {json.dumps(figures[name])}", flush=True)  # each as it comes: a cut run keeps them
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(args, figures)
    print(text)
    if args.cuda:
        replace_block(args.out, "gpu", "## 10. On a GPU\n\n" + text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
