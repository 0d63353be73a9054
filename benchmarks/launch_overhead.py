"""What does nbddp add to a hand-written torchrun run? ``python benchmarks/launch_overhead.py``.

Times, on the bundled torch example (a few epochs, 2 CPU ranks):

* ``torchrun``: the exported script launched by hand, as a person would
  (``python -m torch.distributed.run --standalone --nproc-per-node 2 train.py``);
* ``nbddp run``: the whole notebook: kernel, setup and evaluation cells, the
  job, streaming, weights loaded back on the CPU;
* ``kernel alone``: what the kernel costs by itself (start it, run the
  notebook's setup and evaluation cells with nbclient, no training), i.e. the
  work a person does today beside ``torchrun``;
* ``nbddp --help`` and ``import nbddp``: the paths that must stay light.

``nbddp run`` < ``torchrun`` + ``kernel alone`` shows the kernel overlapping
the ranks; nbddp's own share (start → ranks launched, job end → exit) is
printed from a timed in-process run.

Prints a markdown table of medians (and every sample) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbddp.job.lifecycle import Job
    from nbddp.job.outcome import JobOutcome
    from nbddp.plan.job_spec import JobSpec

REPO = Path(__file__).resolve().parent.parent


def timed(argv: list[str], cwd: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nbddp-bench-"))
    shutil.copy(REPO / "notebooks" / "digits_torch.ipynb", work)
    nbddp = [sys.executable, "-m", "nbddp"]
    subprocess.run([*nbddp, "export", "digits_torch.ipynb", "-o", "train.py", "-p", "epochs", str(args.epochs)],
                   cwd=work, check=True, stderr=subprocess.DEVNULL)
    kernel_only = work / "kernel_only.ipynb"
    _write_without_training(work / "digits_torch.ipynb", kernel_only)
    cases = {
        "import nbddp": [sys.executable, "-c", "import nbddp"],
        "nbddp --help": [*nbddp, "--help"],
        "torchrun by hand": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"],
        "kernel alone (setup + evaluation cells)": [sys.executable, "-m", "jupyter", "execute", kernel_only.name],
        "nbddp run (whole notebook)": [*nbddp, "run", "digits_torch.ipynb", "-p", "epochs", str(args.epochs)],
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeat):  # interleaved, so drift hits every case alike
        for name, argv in cases.items():
            samples[name].append(timed(argv, work))
    own = _own_share(work, args.epochs)
    shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(samples["torchrun by hand"])
    print("| what | median s | vs torchrun by hand | samples |\n|---|---|---|---|")
    for name, values in samples.items():
        median = statistics.median(values)
        delta = f"{median - base:+.2f} s" if "run" in name else ""
        print(f"| {name} | {median:.2f} | {delta} | {', '.join(f'{v:.2f}' for v in values)} |")
    sequential = base + statistics.median(samples["kernel alone (setup + evaluation cells)"])
    print(f"| torchrun + kernel, one after the other | {sequential:.2f} | | |")
    print(f"\nnbddp's own share: {own['to_launch']:.2f} s from start to ranks launched, "
          f"{own['after_job']:.2f} s from the job's end to exit (weights loaded, evaluation, notebook written).")


def _write_without_training(source: Path, target: Path) -> None:
    import nbformat

    nb = nbformat.read(source, as_version=4)
    nb.cells = [c for c in nb.cells if "ddp-train" not in c.source.split("\n", 1)[0]]
    nbformat.write(nb, target)


def _own_share(work: Path, epochs: int) -> dict[str, float]:
    """Time nbddp's own steps in-process: start → Launch, and job end → return."""
    start = time.perf_counter()
    from nbddp.job import lifecycle as job_module
    from nbddp.doors import notebook_run as run_module
    from nbddp.plan.options import LaunchOptions

    marks: dict[str, float] = {}
    original_init, original_wait = job_module.Launch.__init__, job_module.Job.wait

    def init(self: Any, spec: JobSpec) -> None:
        marks["launch"] = time.perf_counter()
        original_init(self, spec)

    def wait(self: Job, *a: Any, **k: Any) -> JobOutcome:
        outcome = original_wait(self, *a, **k)
        marks["job_done"] = time.perf_counter()
        return outcome

    job_module.Launch.__init__, job_module.Job.wait = init, wait
    cwd = os.getcwd()
    os.chdir(work)
    try:
        options = run_module.RunOptions(Path("digits_torch.ipynb"), LaunchOptions(parameters={"epochs": epochs}))
        run_module.run_notebook(options, sinks=[], say=lambda text: None)
    finally:
        os.chdir(cwd)
        job_module.Launch.__init__, job_module.Job.wait = original_init, original_wait
    end = time.perf_counter()
    return {"to_launch": marks["launch"] - start, "after_job": end - marks["job_done"]}


if __name__ == "__main__":
    main()
