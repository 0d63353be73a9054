"""What sharding buys: ``python -m benchmarks.sharding [--out BENCHMARKS.md]``.

Two questions, each answered by real ``nbddp run`` jobs (2 gloo CPU ranks, Adam) of the same notebook,
as DDP and with ``--shard`` (FSDP2):

* **memory and speed** for a ~100M-parameter model (6 ``Linear(4096, 4096)``): each rank's peak RSS
  (``result.json``'s ``peak_memory``, what the view shows), the parameters + gradients + optimizer state
  each rank holds (summed from its own tensors, each storage once), and training steps per second;
* **the largest model that trains** when each rank may grow by at most ``--cap`` GB: the training cell
  sets ``RLIMIT_AS`` to its address space at that point plus the cap, builds a stack of ``Linear(2048,
  2048)`` layers (4.2M parameters each) and trains 2 steps; the deepest stack that succeeds, found
  by bisection, each way.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from benchmarks.document import replace_block

if TYPE_CHECKING:
    from nbddp.job.orchestrator import RunResult

SPEED = """#| ddp-train
import time, resource
net = nbddp.prepare(model)
opt = torch.optim.Adam(net.parameters(), lr=1e-4)
x = torch.randn(8, {width})
def step():
    loss = net(x).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
step()  # the first step allocates the gradients and Adam's state
started = time.perf_counter()
for _ in range({steps}):
    step()
rate = {steps} / (time.perf_counter() - started)
local = lambda t: t.to_local() if hasattr(t, 'to_local') else t
tensors = [local(p) for p in net.parameters()] + [local(p.grad) for p in net.parameters()]
tensors += [local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
held = sum({{t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}}.values())
print('FIGURES', json.dumps({{'rank': nbddp.rank(), 'steps_per_s': rate, 'held': held}}), flush=True)"""
CAPPED = """#| ddp-train
import resource
with open('/proc/self/status') as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmSize:'))
resource.setrlimit(resource.RLIMIT_AS, (size + int({cap} * 1e9), resource.RLIM_INFINITY))
model = nn.Sequential(*[nn.Linear({width}, {width}) for _ in range({depth})])
net = nbddp.prepare(model)
opt = torch.optim.Adam(net.parameters(), lr=1e-4)
for _ in range(2):
    loss = net(torch.randn(8, {width})).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
print('TRAINED', flush=True)
model = None"""


def notebook(folder: Path, name: str, setup: str, train: str) -> Path:
    nb = new_notebook(cells=[new_code_cell(f"#| ddp\nimport json, torch, nbddp\nfrom torch import nn\n{setup}"),
                             new_code_cell(train)],
                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    path = folder / name
    nbformat.write(nb, path)
    return path


def run(path: Path, shard: bool, returns: str = "model") -> RunResult:
    import nbddp

    return nbddp.run(path, cpu=True, nproc=2, shard=shard, returns=returns, quiet=True, collective_timeout=60,
                     run_dir=path.parent / f"run-{path.stem}-{'shard' if shard else 'ddp'}-{time.monotonic_ns()}")


def speed(folder: Path, rounds: int, steps: int) -> dict[str, dict[str, list[float]]]:
    path = notebook(folder, "speed.ipynb", "torch.manual_seed(0)\nmodel = nn.Sequential(*[nn.Linear(4096, 4096) "
                    "for _ in range(6)])", SPEED.format(width=4096, steps=steps))
    figures: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for shard in (False, True):
            result = run(path, shard)
            result.raise_for_status()
            ranks = [json.loads(line.split("FIGURES ", 1)[1]) for line in
                     (result.run_dir / "logs" / "rank-0.log").read_text().splitlines()
                     + (result.run_dir / "logs" / "rank-1.log").read_text().splitlines() if "FIGURES " in line]
            row = figures.setdefault("FSDP2 (--shard)" if shard else "DDP", {"peak": [], "held": [], "rate": []})
            row["peak"].append(max(result.record.peak_memory.values()) / 1e9)
            row["held"].append(max(r["held"] for r in ranks) / 1e9)
            row["rate"].append(min(r["steps_per_s"] for r in ranks))
    return figures


def largest(folder: Path, shard: bool, cap: float, width: int, high: int) -> int:
    """The deepest stack of ``Linear(width, width)`` that trains within ``cap`` GB more per rank (0: none)."""
    low = 0
    while low < high:
        depth = (low + high + 1) // 2
        path = notebook(folder, f"cap{depth}.ipynb", "model = None", CAPPED.format(cap=cap, width=width, depth=depth))
        ok = run(path, shard, returns="model").succeeded
        print(f"  {'FSDP2' if shard else 'DDP'} depth {depth}: {'trains' if ok else 'fails'}", flush=True)
        low, high = (depth, high) if ok else (low, depth - 1)
    return low


def markdown(figures: dict, rounds: int, steps: int, cap: float, width: int, depths: dict[str, int],
             command: str) -> str:
    import torch

    def cell(values: list[float], digits: str) -> str:
        return f"{statistics.median(values):{digits}} ({min(values):{digits}}–{max(values):{digits}})"

    per_layer = width * width + width
    lines = [
        "## 8. Sharded training (FSDP2) vs DDP: memory per rank and speed",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on 2 cores, no GPU, Python "
        f"{platform.python_version()}, torch {torch.__version__}. Command: `{command}`. Real `nbddp run` jobs, 2 gloo CPU ranks, Adam; medians (min–max) of {rounds} rounds.",
        "",
        f"A ~100M-parameter model (6 × `Linear(4096, 4096)`, 100.7M parameters), batch 8, {steps} timed steps:",
        "",
        "| | peak RSS per rank (GB, `result.json`) | parameters + gradients + Adam state held per rank (GB) | steps/s |",
        "|---|---|---|---|",
    ]
    for name, row in figures.items():
        lines.append(f"| {name} | {cell(row['peak'], '.2f')} | {cell(row['held'], '.2f')} | {cell(row['rate'], '.2f')} |")
    ddp, fsdp = figures["DDP"], figures["FSDP2 (--shard)"]
    lines += [
        "",
        f"Held state under FSDP2: {statistics.median(fsdp['held']) / statistics.median(ddp['held']):.2f}× DDP's "
        f"(the test suite asserts ≤ 0.6×); peak RSS {statistics.median(fsdp['peak']) / statistics.median(ddp['peak']):.2f}× "
        "(the peak includes torch itself, ~0.3 GB, and the whole model each rank builds before `prepare` shards it).",
        "Sharding is slower here: each step all-gathers every block twice (forward, backward) and reduce-scatters "
        "the gradients where DDP all-reduces once, over gloo, with one core per rank to overlap nothing. It is for "
        "models that don't fit; on GPUs NCCL overlaps most of it (not measured: no GPU here).",
        "",
        f"The largest model that trains when each rank may grow by at most {cap:g} GB (`RLIMIT_AS` set in the "
        f"training cell to its address space there plus {cap:g} GB; a stack of `Linear({width}, {width})`, "
        f"{per_layer / 1e6:.1f}M parameters each, bisected):",
        "",
        "| | deepest stack that trains | parameters |",
        "|---|---|---|",
    ]
    for name, depth in depths.items():
        lines.append(f"| {name} | {depth} layers | {depth * per_layer / 1e6:.0f}M |")
    if depths.get("DDP"):
        lines += ["", f"Sharding over 2 ranks trains a {depths['FSDP2 (--shard)'] / depths['DDP']:.1f}× larger model "
                      "in the same memory."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharding", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cap", type=float, default=1.5, help="GB each rank may grow by, in the capped runs")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--max-depth", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None, help="write the section into this BENCHMARKS.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nbddp-sharding-") as folder:
        figures = speed(Path(folder), args.rounds, args.steps)
        print(json.dumps(figures), flush=True)
        depths = {name: largest(Path(folder), shard, args.cap, args.width, args.max_depth)
                  for name, shard in (("DDP", False), ("FSDP2 (--shard)", True))}
    command = " ".join(["python -m benchmarks.sharding", *(argv if argv is not None else sys.argv[1:])])
    text = markdown(figures, args.rounds, args.steps, args.cap, args.width, depths, command.replace(" --out BENCHMARKS.md", ""))
    print(text)
    if args.out:
        replace_block(args.out, "sharding", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
