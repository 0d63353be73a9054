"""What a hyperparameter search on warm ranks costs beyond the training: ``python -m benchmarks.tune [--trials N]``.

A study of N trials (default 20) over a notebook whose training takes about 1 s (10 epochs of a small regression
on 2 gloo CPU ranks, each epoch sleeping 0.1 s), searching ``lr`` and ``hidden``, with no pruner (every trial trains
to its end, so both cases do the same work), the same sampler seed:

* **nbddp.tune**: ``nbddp.tune(notebook, space, trials=N)``: every trial on the same warm ranks;
* **a loop of nbddp.run**: the same study with an objective that calls ``nbddp.run(notebook, parameters=...)`` and
  reads the metric from the run's record: what a user writes without ``nbddp.tune``, each trial on fresh ranks.

Each case's total wall time, and per trial its time beyond the training (the trial's wall time less 1 s) as a
median (min–max). The figures go into BENCHMARKS.md's "tune" block (``--out``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.document import cpu_name, replace_block

if TYPE_CHECKING:
    import optuna

TRAINING_SECONDS = 1.0
PARAMS = "lr = 0.05\nhidden = 8\nepochs = 10\nnap = 0.1"
SETUP = "#| ddp\nimport time\nimport torch\nimport nbddp\ntorch.manual_seed(0)\nX = torch.randn(256, 8)\nY = X.sum(1, keepdim=True)"
TRAIN = ("#| ddp-train\n"
         "torch.manual_seed(1)\n"
         "model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))\n"
         "ddp_model = nbddp.prepare(model)\n"
         "opt = torch.optim.SGD(ddp_model.parameters(), lr=lr)\n"
         "for epoch in range(epochs):\n"
         "    opt.zero_grad()\n"
         "    loss = ((ddp_model(X) - Y) ** 2).mean()\n"
         "    loss.backward()\n"
         "    opt.step()\n"
         "    time.sleep(nap)\n"
         "    nbddp.log(val_loss=loss.item(), step=epoch)")
SPACE = ["lr=loguniform(1e-3,0.3)", "hidden=int(4,64)"]


def _notebook(folder: Path) -> Path:
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    cells = [new_code_cell(PARAMS, metadata={"tags": ["parameters"]}), new_code_cell(SETUP), new_code_cell(TRAIN)]
    path = folder / "tune_bench.ipynb"
    nbformat.write(new_notebook(cells=cells), path)
    return path


def _trial_seconds(study: optuna.Study) -> list[float]:
    return [(t.datetime_complete - t.datetime_start).total_seconds() for t in study.trials if t.datetime_complete]


def warm_study(notebook: Path, trials: int) -> tuple[float, list[float], float]:
    import nbddp

    started = time.monotonic()
    result = nbddp.tune(notebook, SPACE, trials=trials, metric="val_loss", pruner="none", seed=0, cpu=True, nproc=2,
                        quiet=True)
    total = time.monotonic() - started
    return total, _trial_seconds(result.study), result.study.best_value


def loop_of_runs(notebook: Path, trials: int) -> tuple[float, list[float], float]:
    import optuna

    import nbddp
    from nbddp.doors.tune.space import parse_space

    space = parse_space(SPACE)

    def objective(trial: optuna.Trial) -> float:
        result = nbddp.run(notebook, parameters=space(trial), cpu=True, nproc=2, quiet=True)
        result.raise_for_status()
        return float(result.record.final_metrics["val_loss"])

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    started = time.monotonic()
    study.optimize(objective, n_trials=trials)
    return time.monotonic() - started, _trial_seconds(study), study.best_value


def _cell(seconds: list[float]) -> str:
    beyond = [s - TRAINING_SECONDS for s in seconds]
    return f"{statistics.median(beyond):.2f} s ({min(beyond):.2f}–{max(beyond):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write the figures into this document (BENCHMARKS.md)")
    args = parser.parse_args(argv)
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)  # (as a user runs it: from the notebook's folder)
        try:
            notebook = _notebook(Path(folder))
            warm = warm_study(notebook, args.trials)
            loop = loop_of_runs(notebook, args.trials)
        finally:
            os.chdir(here)
    budget = args.trials * (TRAINING_SECONDS + 0.3)
    lines = [
        f"## 12. Hyperparameter search: a study on warm ranks ({args.trials} trials of a 1 s training)", "",
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {os.cpu_count()} cores "
        f"({cpu_name()}), no GPU, Python {platform.python_version()}; `python -m benchmarks.tune --trials "
        f"{args.trials}`. Each trial trains 10 epochs of 0.1 s on 2 gloo ranks; no pruner; the same TPE seed.", "",
        "| case | total | per trial beyond the training | best val_loss |", "|---|---|---|---|",
        f"| `nbddp.tune` (every trial on the same warm ranks) | {warm[0]:.1f} s | {_cell(warm[1])} | {warm[2]:.4g} |",
        f"| a loop of `nbddp.run` (each trial on fresh ranks) | {loop[0]:.1f} s | {_cell(loop[1])} | {loop[2]:.4g} |",
        "",
        f"The goal is {args.trials} trials within {budget:.0f} s ({args.trials} × (1 s + 0.3 s)): "
        f"**{'met' if warm[0] <= budget else 'missed'}**, in {warm[0]:.1f} s, the first trial's warm ranks starting "
        f"included. `nbddp.tune` is {loop[0] / warm[0]:.1f}× quicker than the loop. A trial's time runs from Optuna "
        "asking for it to its value; beyond the training it holds writing the trial's script, the warm ranks' hand-over "
        "and the run's record (a loop's trial: a kernel and fresh ranks).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        replace_block(args.out, "tune", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
