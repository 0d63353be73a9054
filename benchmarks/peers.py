"""nbddp beside its closest peers in the notebook edit loop: ``python -m benchmarks.peers``.

Every tool runs the same trivial 2-rank CPU training cell (a ``Linear(4, 1)``, three SGD steps, a
line from each rank) in a real kernel driven by raw execute requests, as a front end sends them,
round after round, the tools interleaved:

* **re-run**: the training cell again, the tool already started (execute request → the kernel idle);
* **after a rank raised**: the next good run, after a run in which rank 1 raised while rank 0
  waited for it in an all-reduce; sent at once, and again ``FIX_SECONDS`` later (a person fixing the
  cell takes longer: what a tool does in the background meanwhile is theirs to gain);
* **after an interrupt**: the next good run, after a run interrupted (the kernel's interrupt, as the
  stop button sends it) while rank 0 waited in an all-reduce and rank 1 slept;
* **first line**: execute request → the first line a rank printed reaching the client as text, and,
  for nbddp, as the widget view's first line (a widget message the page would draw);
* **live text**: whether the ranks' lines reach a client that renders no widgets (nbclient,
  papermill, ``jupyter console``) while the cell runs.

``--setup-cell`` measures instead the re-run of a training cell after a setup cell that takes 3 s
(standing for loading and preparing a dataset), and whether the re-run's weights are, byte for byte,
the first (fresh) run's: the "peers-setup" block.

The peers: nbdistributed 0.1.0 (``%dist_init``, ``%%distributed``), Accelerate's
``notebook_launcher`` (fork), and ``!torchrun`` of a script written beforehand. They are installed in
the benchmark's own environment (a virtual environment in ``benchmarks/.peers``, which sees this
Python's packages), never as dependencies of nbddp. The figures go into BENCHMARKS.md's "peers"
section (``--out``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from benchmarks.document import cpu_name, replace_block

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / "benchmarks" / ".peers"
PEERS = ("nbdistributed==0.1.0", "accelerate>=0.20")
#: How long one cell may take before the benchmark calls it hung (nbdistributed waits 60 s for a dead rank).
CELL_TIMEOUT = 120.0
#: The stalled run is interrupted a second after its ranks said they trained, or this long after it started.
INTERRUPT_BY = 10.0

MODEL = "torch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)"
STEPS = ("opt = torch.optim.SGD({params}, lr=0.1)\n"
         "for _ in range(3):\n    opt.zero_grad(); {model}(torch.ones(8, 4)).sum().backward(); opt.step()\n")
#: What each rank does after training, by case: a clean end; rank 1 raising while rank 0 waits in an
#: all-reduce; rank 1 sleeping while rank 0 waits in one (interrupted by the benchmark).
ENDINGS = {
    "ok": "",
    "raise": "if {rank} == 1:\n    raise ValueError('boom')\ntorch.distributed.all_reduce(torch.ones(1))\n",
    "stall": "if {rank} == 1:\n    time.sleep(60)\ntorch.distributed.all_reduce(torch.ones(1))\n",
}


@dataclass
class Tool:
    name: str
    setup: list[str]
    cell: dict[str, str]
    """The training cell for each case of :data:`ENDINGS`."""
    notes: list[str] = field(default_factory=list)
    kernel: str = "python3"
    """The Jupyter kernel it runs in."""


def _indent(code: str, by: str = "    ") -> str:
    return "".join(by + line + "\n" if line else "\n" for line in code.splitlines())


def nbddp_tool() -> Tool:
    body = ("print('FIRST', nbddp.rank(), flush=True)\nddp = nbddp.prepare(model)\n"
            + STEPS.format(params="ddp.parameters()", model="ddp") + "print(f'TRAINED_{nbddp.rank()}', flush=True)\n")
    cells = {case: "%%ddp_train --cpu\n" + body + end.format(rank="nbddp.rank()") for case, end in ENDINGS.items()}
    return Tool("nbddp (`%%ddp_train`, weights back)", ["%load_ext nbddp", "#| ddp\nimport time, torch, nbddp\n" + MODEL],
                cells)


def nbdistributed_tool() -> Tool:
    body = ("print('FIRST', rank, flush=True)\nimport time, torch\n" + MODEL
            + "\nddp = torch.nn.parallel.DistributedDataParallel(model)\n"
            + STEPS.format(params="ddp.parameters()", model="ddp") + "print(f'TRAINED_{rank}', flush=True)\n")
    cells = {case: "%%distributed\n" + body + end.format(rank="rank") for case, end in ENDINGS.items()}
    return Tool("nbdistributed 0.1.0", ["%load_ext nbdistributed", "%dist_init -n 2"], cells)


def accelerate_tool() -> Tool:
    function = ("def train_fn(ending):\n    from accelerate import Accelerator\n    accelerator = Accelerator(cpu=True)\n"
                "    rank = accelerator.process_index\n    print('FIRST', rank, flush=True)\n    " + MODEL.replace("\n", "\n    ")
                + "\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n    model, opt = accelerator.prepare(model, opt)\n"
                "    for _ in range(3):\n        opt.zero_grad(); accelerator.backward(model(torch.ones(8, 4)).sum()); opt.step()\n"
                "    print(f'TRAINED_{rank}', flush=True)\n"
                "    exec(ending, {'rank': rank, 'torch': torch, 'time': time})\n")
    cells = {case: f"notebook_launcher(train_fn, args=({end.format(rank='rank')!r},), num_processes=2)"
             for case, end in ENDINGS.items()}
    return Tool("Accelerate `notebook_launcher`", ["import time, torch\nfrom accelerate import notebook_launcher\n" + function],
                cells)


def torchrun_tool(work: Path) -> Tool:
    script = ("import sys, time, torch, torch.distributed as dist\n\nif __name__ == '__main__':\n"
              "    dist.init_process_group('gloo')\n    rank = dist.get_rank()\n    print('FIRST', rank, flush=True)\n"
              + _indent(MODEL + "\nddp = torch.nn.parallel.DistributedDataParallel(model)\n"
                        + STEPS.format(params="ddp.parameters()", model="ddp") + "print(f'TRAINED_{rank}', flush=True)\n"
                        + f"exec({ {case: end.format(rank='rank') for case, end in ENDINGS.items()}!r}[sys.argv[1]], "
                        + "{'rank': rank, 'torch': torch, 'time': time})\n"
                        + "if rank == 0:\n    torch.save(model.state_dict(), 'weights.pt')\ndist.destroy_process_group()"))
    (work / "peer_train.py").write_text(script)
    cells = {case: f"!{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 peer_train.py {case}"
             for case in ENDINGS}
    return Tool("`!torchrun` (script written beforehand)", [], cells)


# ---------------------------------------------------------------- a kernel, as a front end without widgets drives it


@dataclass
class Execution:
    seconds: float
    first_text: float | None
    """Execute request → the first ``FIRST`` line received as text (stream or display_data)."""
    first_widget: float | None
    """Execute request → the first ``FIRST`` line in a widget message (nbddp's live view)."""
    lines_before_end: bool
    """A rank's line reached the client as text while the cell ran (before it was interrupted)."""
    output: str
    raised: bool = False
    """The cell ended with an error."""

    def trained(self) -> bool:
        """Every rank trained, and the cell didn't fail: a straggler of the run before that prints ``TRAINED``
        into this cell's output doesn't count. (One token a rank: ranks sharing a pipe interleave a print's parts.)"""
        return not self.raised and all(f"TRAINED_{rank}" in self.output for rank in (0, 1))


class Kernel:
    def __init__(self, cwd: Path, kernel_name: str = "python3") -> None:
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name=kernel_name)
        # As in an activated environment: nbdistributed starts its workers with the `python` on PATH.
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        self.km.start_kernel(cwd=str(cwd), env={**os.environ, "PYTHONUNBUFFERED": "1", "PATH": path})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def start(self, code: str) -> tuple[str, float]:
        return self.kc.execute(code), time.monotonic()

    def finish(self, msg_id: str, started: float, interrupt_when: str | None = None) -> Execution:
        """Collect the cell's messages until the kernel is idle; interrupt it a second after ``interrupt_when``
        was seen (rank 0 then waits in its all-reduce), or after :data:`INTERRUPT_BY` if it never shows."""
        text, first_text, first_widget, live, seen_at, interrupted = [], None, None, False, None, False
        raised = False
        if interrupt_when:
            seen_at = started + INTERRUPT_BY - 1.0
        deadline = started + CELL_TIMEOUT
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty: nothing this second
                msg = None
            now = time.monotonic()
            if seen_at is not None and now - seen_at > 1.0:
                self.km.interrupt_kernel()
                seen_at, interrupt_when, interrupted = None, None, True
            if now > deadline:
                self.km.interrupt_kernel()
                deadline = now + 30
                text.append(f"[benchmark] no end after {CELL_TIMEOUT:.0f}s: interrupted\n")
            if msg is None or msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            chunk = ""
            if kind == "stream":
                chunk = content["text"]
            elif kind in ("display_data", "update_display_data", "execute_result"):
                chunk = content["data"].get("text/plain", "") if kind != "update_display_data" else ""
            elif kind == "error":
                chunk, raised = "\n".join(content["traceback"]), True
            elif kind in ("comm_open", "comm_msg") and first_widget is None and "FIRST" in str(content.get("data", {})):
                first_widget = now - started
            if chunk:
                text.append(chunk)
                if "FIRST" in chunk and first_text is None:
                    first_text = now - started
                if ("FIRST" in chunk or "TRAINED" in chunk) and not interrupted:
                    live = True  # (lines that only come once the cell is interrupted don't count)
                if interrupt_when and interrupt_when in chunk:
                    seen_at, interrupt_when = min(now, seen_at), None
            if kind == "status" and content["execution_state"] == "idle":
                return Execution(now - started, first_text, first_widget, live, "".join(text), raised)

    def run(self, code: str, interrupt_when: str | None = None) -> Execution:
        return self.finish(*self.start(code), interrupt_when=interrupt_when)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


# ---------------------------------------------------------------- the rounds


RERUN, AFTER_RAISE, AFTER_RAISE_PAUSED, AFTER_INTERRUPT, FIRST_TEXT, FIRST_WIDGET, LIVE = ROWS = (
    "re-run of the training cell", "next run after a rank raised", "next run 1 s after a rank raised",
    "next run after an interrupt", "first line in the cell (text)", "first line in the cell (widget)",
    "live text without widgets")
#: A user fixing the failed cell takes longer than this: what a tool does in the background meanwhile counts.
FIX_SECONDS = 1.0


def measure(tools: list[Tool], work: Path, rounds: int, log: Callable[[str], None]) -> dict[str, dict[str, list]]:
    """Every row for every tool, round after round. A tool whose next run after a failure (or an interrupt)
    doesn't train is broken by it: its kernel is started again, and that row isn't measured again."""
    figures: dict[str, dict[str, list]] = {tool.name: {row: [] for row in ROWS} for tool in tools}
    kernels: dict[str, Kernel] = {}
    broken: dict[str, set[str]] = {tool.name: set() for tool in tools}

    def start(tool: Tool) -> None:
        kernel = kernels[tool.name] = Kernel(work)
        for cell in tool.setup:
            kernel.run(cell)
        kernel.run(tool.cell["ok"])  # the tool's first run (starts its workers)

    def after(tool: Tool, case: str, row: str, pause: float = 0.0) -> None:
        if row in broken[tool.name]:
            return
        kernel = kernels[tool.name]
        failed = kernel.run(tool.cell[case], interrupt_when="TRAINED" if case == "stall" else None)
        if case == "stall":
            figures[tool.name][LIVE].append(failed.lines_before_end)
        time.sleep(pause)
        next_run = kernel.run(tool.cell["ok"])
        trained = next_run.trained()
        figures[tool.name][row].append(next_run.seconds if trained else None)
        if not trained:
            broken[tool.name].add(row)
            tool.notes.append(f"after its {'failed' if case == 'raise' else 'interrupted'} run the next run failed "
                              f"(its kernel was restarted to go on):\n\n```\n{next_run.output[-800:].strip()}\n```")
            kernel.close()
            start(tool)

    try:
        for tool in tools:  # started once, as a user's kernel is
            start(tool)
        for round_ in range(rounds):
            for tool in tools:
                good = kernels[tool.name].run(tool.cell["ok"])
                _check(tool, good, "ok")
                row = figures[tool.name]
                row[RERUN].append(good.seconds)
                for row_name, seconds in ((FIRST_TEXT, good.first_text), (FIRST_WIDGET, good.first_widget)):
                    if seconds is not None:
                        row[row_name].append(seconds)
                after(tool, "raise", AFTER_RAISE)
                after(tool, "raise", AFTER_RAISE_PAUSED, pause=FIX_SECONDS)
                after(tool, "stall", AFTER_INTERRUPT)
                log(f"round {round_ + 1}/{rounds} {tool.name}: re-run {good.seconds:.2f}s, after a failure "
                    f"{row[AFTER_RAISE][-1:]}, {FIX_SECONDS:.0f} s after one {row[AFTER_RAISE_PAUSED][-1:]}, "
                    f"after an interrupt {row[AFTER_INTERRUPT][-1:]}")
    finally:
        for kernel in kernels.values():
            kernel.close()
    return figures


def _check(tool: Tool, execution: Execution, case: str) -> None:
    if case == "ok" and not execution.trained():
        tool.notes.append(f"a good run did not train:\n{execution.output[-1500:]}")


def summary(values: list) -> str:
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if values and all(isinstance(v, bool) for v in values):
        return "live text" if all(values) else ("**none until the cell ends**" if not any(values) else "sometimes")
    if not values:
        return "n/a"
    if not numbers:
        return "**broken**: the next run failed (see below)" if len(values) == 1 else "n/a"
    med = statistics.median(numbers)
    failed = len(values) - len(numbers)
    spread = f" ({min(numbers):.2f}–{max(numbers):.2f})" if len(numbers) > 1 else ""
    return f"{med:.2f} s{spread}" + (f"; **broken** in {failed} of {len(values)}" if failed else "")


def measured() -> str:
    """When and where the figures were measured, for a block's first line."""
    return (f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {os.cpu_count()} cores ({cpu_name()}), "
            f"no GPU, Python {platform.python_version()}")


def _table(figures: dict[str, dict[str, list]], rows: tuple[str, ...],
           cell: Callable[[list], str] = summary) -> list[str]:
    """A row per figure, a column per tool; ``cell`` writes one tool's values of one row."""
    names = list(figures)
    return (["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
            + [f"| {row} | " + " | ".join(cell(figures[name][row]) for name in names) + " |" for row in rows])


def markdown(figures: dict[str, dict[str, list]], rounds: int, tools: list[Tool]) -> str:
    lines = ["## 7. Peers: the edit loop side by side", "",
             f"{measured()}; {rounds} rounds, the tools interleaved; `python -m benchmarks.peers`. "
             "A trivial 2-rank CPU training cell in a real kernel driven by raw execute requests (a front end that "
             "renders no widgets, as nbclient, papermill and `jupyter console` are); medians with min–max.", "",
             *_table(figures, ROWS)]
    for tool in tools:
        for note in dict.fromkeys(tool.notes):
            lines += ["", f"{tool.name}: {note}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- a re-run after a 3 s setup cell

#: Every tool's setup: 3 s of loading (a sleep), a seeded model and data; its training: 3 SGD steps, then the
#: digest of the weights (byte for byte) as the tool's rank 0 (or its kernel) sees them.
SETUP_WORK = ("time.sleep(3)  # loading and preparing a dataset\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\n"
              "X = torch.randn(64, 4)\ny = X.sum(1, keepdim=True)\n")
WEIGHTS = ("print('WEIGHTS', hashlib.sha1(b''.join(p.detach().numpy().tobytes() for p in {model}.parameters()))"
           ".hexdigest(), flush=True)\n")
SETUP_STEPS = ("opt = torch.optim.SGD({params}, lr=0.1)\nfor _ in range(3):\n"
               "    opt.zero_grad(); torch.nn.functional.mse_loss({model}(X), y).backward(); opt.step()\n")


def setup_tools(work: Path) -> dict[str, tuple[list[str], str, str]]:
    """Each tool's ``(setup cells, training cell, cell printing the weights' digest or "")``."""
    nbddp_train = "%%ddp_train --cpu\nddp = nbddp.prepare(model)\n" + SETUP_STEPS.format(params="ddp.parameters()", model="ddp")
    distributed = ("%%distributed\nddp = torch.nn.parallel.DistributedDataParallel(model)\n"
                   + SETUP_STEPS.format(params="ddp.parameters()", model="ddp") + "if rank == 0:\n"
                   + _indent(WEIGHTS.format(model="model")))
    function = ("def train_fn():\n    from accelerate import Accelerator\n    accelerator = Accelerator(cpu=True)\n"
                "    net = accelerator.prepare(model)\n" + _indent(SETUP_STEPS.format(params="net.parameters()", model="net"))
                + "    if accelerator.process_index == 0:\n" + _indent(WEIGHTS.format(model="model"), "        "))
    script = ("import hashlib, time, torch, torch.distributed as dist\n" + SETUP_WORK
              + "\nif __name__ == '__main__':\n    dist.init_process_group('gloo')\n"
              + _indent("ddp = torch.nn.parallel.DistributedDataParallel(model)\n"
                        + SETUP_STEPS.format(params="ddp.parameters()", model="ddp")
                        + "if dist.get_rank() == 0:\n" + _indent(WEIGHTS.format(model="model"))
                        + "dist.destroy_process_group()"))
    (work / "peer_setup_train.py").write_text(script)
    return {
        "nbddp (`%%ddp_train`)": (["%load_ext nbddp", "#| ddp\nimport hashlib, time, torch, nbddp\n" + SETUP_WORK],
                                  nbddp_train, "import hashlib\n" + WEIGHTS.format(model="model")),
        "nbdistributed 0.1.0": (["%load_ext nbdistributed", "%dist_init -n 2",
                                 "%%distributed\nimport hashlib, time, torch\n" + SETUP_WORK], distributed, ""),
        "Accelerate `notebook_launcher`": (["import hashlib, time, torch\nfrom accelerate import notebook_launcher\n"
                                            + SETUP_WORK, function], "notebook_launcher(train_fn, num_processes=2)", ""),
        "`!torchrun` (script written beforehand)": (
            [], f"!{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 peer_setup_train.py", ""),
    }


def measure_setup(work: Path, rounds: int, log: Callable[[str], None]) -> dict[str, dict[str, list]]:
    """Per tool: the re-runs' seconds, and whether each re-run's weights are the first run's."""
    import importlib.util

    found: dict[str, dict[str, list]] = {}
    for name, (setup, train, digest) in setup_tools(work).items():
        if name.startswith("nbdistributed") and importlib.util.find_spec("nbdistributed") is None:
            found[name] = {"missing": ["nbdistributed is not installed in this environment"]}
            continue
        kernel = Kernel(work)
        try:
            for cell in setup:
                kernel.run(cell)
            first = kernel.run(train)
            reference = _digest(kernel, first, digest)
            seconds, same = [], []
            for _ in range(rounds):
                again = kernel.run(train)
                seconds.append(again.seconds if not again.raised else None)
                same.append(reference is not None and _digest(kernel, again, digest) == reference)
            found[name] = {"seconds": seconds, "same": same}
            log(f"{name}: re-runs {seconds}, weights equal the first run's: {same}")
        finally:
            kernel.close()
    return found


def _digest(kernel: Kernel, execution: Execution, cell: str) -> str | None:
    text = kernel.run(cell).output if cell else execution.output
    return text.split("WEIGHTS", 1)[1].split()[0] if "WEIGHTS" in text else None


def setup_markdown(found: dict[str, dict[str, list]], rounds: int) -> str:
    lines = ["### Re-run with a 3 s setup cell", "",
             f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {os.cpu_count()} cores, no GPU, Python "
             f"{platform.python_version()}; `python -m benchmarks.peers --setup-cell --rounds {rounds}`. A setup that "
             "takes 3 s (a sleep standing for loading a dataset) and builds a seeded model, then a 2-rank CPU training "
             "cell (3 SGD steps) re-run unchanged; medians with min–max; the weights compared byte for byte with "
             "the first run's (a fresh run's).", "",
             "| | re-run with a 3 s setup cell | re-run's weights equal a fresh run's |", "|---|---|---|"]
    for name, figures in found.items():
        if "missing" in figures:
            lines.append(f"| {name} | not measured here: {figures['missing'][0]} | — |")
            continue
        same = figures["same"]
        verdict = ("yes, byte for byte" if same and all(same)
                   else f"**no**: {same.count(False)} of {len(same)} re-runs differ")
        lines.append(f"| {name} | {summary(figures['seconds'])} | {verdict} |")
    lines += ["", "nbddp runs the setup once and keeps it on its warm ranks, putting back after each run what the run "
              "changed (README, \"The setup is kept too\"). nbdistributed keeps its workers' namespace too, and "
              "runs only the cell sent, so its re-run starts from the model the last run trained: fast, and not a "
              "fresh run's weights (by design). Accelerate's "
              "`notebook_launcher` forks the kernel, so a setup run in the kernel before the launch is inherited on "
              "the CPU; CUDA can't be forked, so on GPUs the setup goes inside the launched function and runs every "
              "time. `!torchrun` runs the whole script every time."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the benchmark's own environment


def ensure_environment() -> Path:
    """The virtual environment the peers are installed in (made once; it sees this Python's packages)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PEERS], check=True)
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="write the section into this BENCHMARKS.md")
    parser.add_argument("--only", nargs="*", default=None, help="tools to run (nbddp nbdistributed accelerate torchrun)")
    parser.add_argument("--setup-cell", action="store_true",
                        help="measure the re-run after a 3 s setup cell instead (the peers-setup block)")
    parser.add_argument("--first-run", action="store_true",
                        help="measure the first run in fresh kernels instead (--rounds kernels per tool and row; the "
                             "peers-first block), nbddp in a plain kernel and in the nbddp kernel")
    parser.add_argument("--busy", type=int, default=2, metavar="N",
                        help="--first-run: a row more with N processes busy beside (a loaded machine; 0: none)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # running in the peers' environment
    args = parser.parse_args(argv)
    if not args.inside:
        python = ensure_environment()
        return subprocess.call([str(python), "-m", "benchmarks.peers", "--inside", *(argv or sys.argv[1:])], cwd=REPO)
    if args.setup_cell:
        with tempfile.TemporaryDirectory(prefix="nbddp-peers-") as folder:
            text = setup_markdown(measure_setup(Path(folder), args.rounds, lambda line: print(line, flush=True)),
                                  args.rounds)
        print(text)
        if args.out:
            replace_block(args.out, "peers-setup", text)
        return 0
    with tempfile.TemporaryDirectory(prefix="nbddp-peers-") as folder:
        work = Path(folder)
        makers = {"nbddp": nbddp_tool, "nbdistributed": nbdistributed_tool, "accelerate": accelerate_tool,
                  "torchrun": lambda: torchrun_tool(work)}
        tools = [make() for name, make in makers.items() if not args.only or name in args.only]

        def log(text: str) -> None:
            print(text, flush=True)

        if args.first_run:
            from benchmarks.first_run import first_markdown, measure_first, nbddp_kernel_tool

            if not args.only or "nbddp" in args.only:
                tools.insert(1, nbddp_kernel_tool(work))
            figures = measure_first(tools, work, args.rounds, log, busy=args.busy)
            text = first_markdown(figures, args.rounds, tools, args.busy)
        else:
            text = markdown(measure(tools, work, args.rounds, log), args.rounds, tools)
    print(text)
    if args.out:
        replace_block(args.out, "peers-first" if args.first_run else "peers", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
