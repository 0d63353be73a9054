"""The first training run in a fresh kernel: nbddp beside its peers, and where nbddp's time goes.

``python -m benchmarks.peers --first-run`` (the "peers-first" block): each tool's setup cells run back to back in a
fresh kernel, then the same trivial 2-rank training cell (:mod:`benchmarks.peers`), timed from its execute request to
the kernel idle: at once, after a pause (a person reading the cell), and at once with processes busy beside (a loaded
machine), the tools interleaved kernel by kernel. nbddp runs twice: in a plain kernel (``%load_ext nbddp`` starts the
warm ranks' starter) and in the nbddp kernel (``nbddp kernel install``: the kernel starts it as it starts), installed
into the benchmark's own folder.

``python -m benchmarks.first_run`` (the "first-run-where" block): where nbddp's first run goes, back to back in a fresh
kernel. The starter's imports, each in a fresh interpreter, with the garbage collector on and off (what the collections
torch's import sets off cost: nbddp's starter imports with it off); and the run's timeline, read from the pool's folder
(the starter's ``preloaded.json``, each rank's ``ready/R``, written as it joined its group) and from the starter's
children (the ranks it forked), against the cells' execute requests.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from benchmarks.document import replace_block
from benchmarks.peers import FIX_SECONDS, Kernel, Tool, _check, _table, measured, nbddp_tool, summary

FIRST_AT_ONCE, FIRST_AFTER_PAUSE = ("first run in a fresh kernel, its setup cells just run",
                                    f"first run in a fresh kernel, {FIX_SECONDS * 3:.0f} s after its setup cells")


def loaded_row(busy: int) -> str:
    return f"the same, its setup cells just run, {busy} processes busy beside"


def first_rows(busy: int) -> tuple[str, ...]:
    return (FIRST_AT_ONCE, FIRST_AFTER_PAUSE, *((loaded_row(busy),) if busy else ()))


def nbddp_kernel_tool(work: Path) -> Tool:
    """nbddp in the nbddp kernel, installed under ``work`` (and found there through ``JUPYTER_PATH``)."""
    from nbddp.doors.jupyter.kernelspec import KERNEL_NAME, install

    folder = install(prefix=str(work / "kernels"))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, (str(folder.parent.parent),
                                                               os.environ.get("JUPYTER_PATH"))))
    plain = nbddp_tool()
    return Tool("nbddp in the nbddp kernel (`nbddp kernel install`)", plain.setup, plain.cell, kernel=KERNEL_NAME)


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes spinning on the CPU meanwhile, at the same priority (a machine loaded by other work)."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()


def measure_first(tools: list[Tool], work: Path, kernels: int, log: Callable[[str], None],
                  busy: int = 0) -> dict[str, dict[str, list]]:
    """Each tool's first training run in fresh kernels (``kernels`` of each per row, the tools interleaved): the setup
    cells run back to back, then the training cell at once, after a pause, or at once beside ``busy`` spinning
    processes."""
    cases = [(FIRST_AT_ONCE, 0.0, 0), (FIRST_AFTER_PAUSE, FIX_SECONDS * 3, 0)] + ([(loaded_row(busy), 0.0, busy)]
                                                                               if busy else [])
    figures: dict[str, dict[str, list]] = {tool.name: {row: [] for row, _, _ in cases} for tool in tools}
    for round_ in range(kernels):
        for row, pause, spinning in cases:
            for tool in tools:
                with busy_processes(spinning):
                    kernel = Kernel(work, tool.kernel)
                    try:
                        for cell in tool.setup:
                            kernel.run(cell)
                        time.sleep(pause)
                        first = kernel.run(tool.cell["ok"])
                    finally:
                        kernel.close()
                _check(tool, first, "ok")
                figures[tool.name][row].append(first.seconds if first.trained() else None)
                log(f"kernel {round_ + 1}/{kernels} {tool.name}, {row}: {first.seconds:.2f}s")
    return figures


def first_markdown(figures: dict[str, dict[str, list]], kernels: int, tools: list[Tool], busy: int = 0) -> str:
    lines = ["### The first run in a fresh kernel", "",
             f"{measured()}; {kernels} fresh kernels per tool and row, the tools interleaved; "
             f"`python -m benchmarks.peers --first-run --rounds {kernels}{f' --busy {busy}' if busy != 2 else ''}`. "
             "A fresh kernel runs the tool's setup cells (nbddp: `%load_ext nbddp` and a `#| ddp` cell importing "
             "torch and building the model; Accelerate: importing torch and Accelerate, defining the function; "
             "nbdistributed: loading it and `%dist_init -n 2`, which starts its workers), then the same trivial "
             "training cell as above, timed from its execute request to the kernel idle; medians with min–max. "
             "nbddp in the nbddp kernel: the same cells in a kernel that started the warm ranks' starter as it "
             "started (`nbddp kernel install`)."
             + (" The busy processes spin on the CPU (`while True: pass`), at the same priority, from before the "
                "kernel starts to its end." if busy else ""), "",
             *_table(figures, first_rows(busy), lambda values: "**failed** every time (see below)"
                     if values and not any(values) else summary(values))]
    for tool in tools:
        if tool.notes:  # (the first: the others differ by a message id at most)
            more = f" ({len(tool.notes)} times)" if len(tool.notes) > 1 else ""
            lines += ["", f"{tool.name}{more}: {tool.notes[0]}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- where nbddp's first run goes

#: One fresh interpreter's import of what the warm ranks' starter imports, phase by phase, the collector on or off
#: (``sys.argv[1]``), and the seconds its collections took: a JSON line.
IMPORTS = r"""
import gc, importlib, json, sys, time
spent, began = [0.0], [0.0]
def watch(phase, info):
    if phase == "start":
        began[0] = time.perf_counter()
    else:
        spent[0] += time.perf_counter() - began[0]
gc.callbacks.append(watch)
if sys.argv[1] == "off":
    gc.disable()
marks = [time.perf_counter()]
from nbddp.launchers import forked_rank
from nbddp.launchers.warm import agent
marks.append(time.perf_counter())
import torch
marks.append(time.perf_counter())
for module in agent.PRELOADED:
    if module not in forked_rank.DDP_IMPORTS:
        importlib.import_module(module)
marks.append(time.perf_counter())
for module in forked_rank.DDP_IMPORTS:
    importlib.import_module(module)
marks.append(time.perf_counter())
print(json.dumps({"phases": [b - a for a, b in zip(marks, marks[1:])], "collecting": spent[0]}))
"""
PHASES = ("the starter's own modules (nbddp's launcher side)", "`import torch`",
          "nbddp's rank side and torch.distributed", "`torch._dynamo` (DDP's constructor imports it)")


def measure_imports(rounds: int, log: Callable[[str], None]) -> dict[str, list[dict]]:
    """The starter's imports in fresh interpreters, the collector on and off in turn."""
    found: dict[str, list[dict]] = {"on": [], "off": []}
    for round_ in range(rounds):
        for mode in ("on", "off"):
            out = subprocess.run([sys.executable, "-c", IMPORTS, mode], capture_output=True, text=True, check=True)
            found[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            log(f"imports {round_ + 1}/{rounds}, the collector {mode}: {sum(found[mode][-1]['phases']):.2f}s")
    return found


EVENTS = ("starter running", "setup cell done", "starter's imports done", "ranks forked", "ranks in their group",
          "cell idle")


class Timeline:
    """When each event of a first run happened, relative to the first cell's execute request, from what the pool's
    folder and the kernel's processes show (looked at every 5 ms, from a thread, while the cells run)."""

    def __init__(self, kernel: Kernel) -> None:
        self.pid = kernel.km.provisioner.process.pid
        self.seen: dict[str, float] = {}
        self.zero = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        self.zero = time.time()
        self._thread.start()

    def mark(self, event: str) -> None:
        self.seen.setdefault(event, time.time() - self.zero)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.seen

    def _watch(self) -> None:
        import psutil

        from nbddp.contracts.pool_dir import FOLDER_PREFIX, PoolDir

        folders = f"{tempfile.gettempdir()}/{FOLDER_PREFIX}{self.pid}-*"
        starter = None
        while not self._stop.wait(0.005):
            for pool in map(PoolDir, glob.glob(folders)):
                if starter is None:
                    with contextlib.suppress(OSError, ValueError, KeyError):
                        starter = json.loads(pool.description.read_text())["pid"]
                        self.seen["starter running"] = _started_at(starter) - self.zero
                with contextlib.suppress(OSError):
                    self.seen.setdefault("starter's imports done", pool.preloaded.stat().st_mtime - self.zero)
                readies = [path.stat().st_mtime for path in pool.ready_dir.glob("*")]
                if len(readies) == 2:
                    self.seen.setdefault("ranks in their group", max(readies) - self.zero)
            if starter is not None and "ranks forked" not in self.seen:
                with contextlib.suppress(psutil.Error):
                    if len(psutil.Process(starter).children()) == 2:
                        self.mark("ranks forked")


def _started_at(pid: int) -> float:
    """When process ``pid`` started, on the ``time.time()`` clock, to the clock tick (``psutil``'s ``create_time``
    counts from the boot time in whole seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))


def measure_timeline(kernels: int, work: Path, log: Callable[[str], None]) -> dict[str, list[dict[str, float]]]:
    """nbddp's first run back to back in ``kernels`` fresh kernels of each kind, interleaved."""
    tools = [nbddp_tool(), nbddp_kernel_tool(work)]
    found: dict[str, list[dict[str, float]]] = {tool.kernel: [] for tool in tools}
    for round_ in range(kernels):
        for tool in tools:
            kernel = Kernel(work, tool.kernel)
            timeline = Timeline(kernel)
            try:
                timeline.start()
                for cell in tool.setup:
                    kernel.run(cell)
                timeline.mark("setup cell done")
                sent = time.time() - timeline.zero
                first = kernel.run(tool.cell["ok"])
                timeline.mark("cell idle")
            finally:
                seen = timeline.stop()
                kernel.close()
            if first.trained():
                found[tool.kernel].append({**seen, "training cell sent": sent})
            log(f"kernel {round_ + 1}/{kernels} {tool.kernel}: " + ", ".join(
                f"{name} {seen[name]:.2f}" for name in EVENTS if name in seen))
    return found


def where_markdown(imports: dict[str, list[dict]], timelines: dict[str, list[dict[str, float]]], rounds: int) -> str:
    lines = ["### Where nbddp's first run goes", "",
             f"{measured()}; `python -m benchmarks.first_run --rounds {rounds}`; medians with min–max.", "",
             "The warm ranks' starter's imports, each round in a fresh interpreter:", "",
             "| | the collector on | the collector off (as nbddp's starter imports) |", "|---|---|---|"]
    for index, phase in enumerate(PHASES):
        lines.append(f"| {phase} | " + " | ".join(summary([r["phases"][index] for r in imports[mode]])
                                                  for mode in ("on", "off")) + " |")
    lines.append("| in all | " + " | ".join(summary([sum(r["phases"]) for r in imports[mode]])
                                            for mode in ("on", "off")) + " |")
    lines.append(f"| of which the collector's own collections | {summary([r['collecting'] for r in imports['on']])} "
                 f"| {summary([r['collecting'] for r in imports['off']])} |")
    lines += ["", "A first run back to back (`%load_ext nbddp`, the setup cell importing torch, the training cell at "
              "once), each event's time from the first cell's execute request, in fresh kernels:", "",
              "| event | plain kernel (`%load_ext nbddp` starts the starter) | the nbddp kernel (it started it) |",
              "|---|---|---|"]
    for event in EVENTS:
        lines.append(f"| {event} | " + " | ".join(summary([t[event] for t in timelines[kind] if event in t])
                                                  for kind in timelines) + " |")
    lines.append("| **the training cell** (sent → idle) | " + " | ".join(
        summary([t["cell idle"] - t["training cell sent"] for t in timelines[kind]]) for kind in timelines) + " |")
    lines += ["", "A negative time is before the first cell: the nbddp kernel started the starter as it started. The "
              "pool's files give the starter's end of imports and each rank's joining its group (their write "
              "times); the ranks' fork is seen among the starter's children, looked at every 5 ms. Those looks take "
              "CPU of their own on 2 cores: the training cell's time to compare with the peers is \"The first run in "
              "a fresh kernel\" above, measured without them."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="fresh interpreters and kernels of each kind")
    parser.add_argument("--out", type=Path, default=None, help="write the block into this BENCHMARKS.md")
    args = parser.parse_args(argv)

    def log(text: str) -> None:
        print(text, flush=True)

    imports = measure_imports(args.rounds, log)
    with tempfile.TemporaryDirectory(prefix="nbddp-first-run-") as folder:
        timelines = measure_timeline(args.rounds, Path(folder), log)
    text = where_markdown(imports, timelines, args.rounds)
    print(text)
    if args.out:
        replace_block(args.out, "first-run-where", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
