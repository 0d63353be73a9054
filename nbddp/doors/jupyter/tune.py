"""``nbddp.objective(space, metric)`` in a kernel: Optuna's own loop over the kernel's training cell, on its warm ranks.

``study.optimize(nbddp.objective(space, metric="val_loss"), n_trials=20)``: each trial runs the last ``%%ddp_train``
cell this kernel ran, with that cell's options, its values overriding the names the cell takes from the kernel as
``-p`` does (:class:`KernelTrials`), on the kernel's warm ranks (the same ones ``%%ddp_train`` uses; ``%ddp_ranks``
shows them). ``cell="..."`` gives the training code instead; ``notebook="nb.ipynb"`` a notebook's training cells.
The shared objective (:class:`~nbddp.doors.tune.objective.Objective`) reports, prunes and fails trials; this module
finds the cell and shows the study in the cell's output (:class:`StudyView`: a line per trial, the study's best value
and the running trial's curve, redrawn as the metric is logged). Each trial's weights stay in its run dir
(``study.best_trial.user_attrs["run_dir"]``): the kernel's namespace is left as it was.
"""

from __future__ import annotations

import html
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from nbddp.contracts.errors import UsageError
from nbddp.contracts.metrics import step_of
from nbddp.display.metric_plot import svg_plot
from nbddp.doors.jupyter.kernel_cells import build_script
from nbddp.doors.jupyter.kernel_pool import kernel_pool
from nbddp.doors.jupyter.session import session_notebook
from nbddp.doors.tune.objective import NotebookTrials, Objective, TrialEnd, params_text
from nbddp.doors.tune.space import Space
from nbddp.job import orchestrator
from nbddp.job.follow import Event, MetricsEvent, Sink
from nbddp.plan.options import LaunchOptions

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from nbddp.doors.jupyter.magics import DdpMagics

#: Said where the kernel has run no ``%%ddp_train`` cell and none is given.
NO_TRAINING_CELL = ("nbddp.objective runs the kernel's training cell: run a %%ddp_train cell first (its options and "
                    "code are each trial's), or give the code (cell=\"...\") or a notebook (notebook=\"nb.ipynb\")")
#: Said outside a kernel, where there is no %%ddp_train cell to run.
NO_KERNEL = ("nbddp.objective runs a Jupyter kernel's training cell: call it in a kernel, after a %%ddp_train cell, or "
             "give a notebook (notebook=\"nb.ipynb\"); nbddp.tune runs a notebook's whole study from Python")
#: How often the view is redrawn at most while a trial runs.
REDRAW_SECONDS = 0.5


def objective(space: Space, metric: str | Sequence[str] = "val_loss", *, cell: str | None = None,
              options: str | None = None, notebook: str | Path | None = None,
              value: Callable[[orchestrator.RunResult], Any] | None = None) -> Objective:
    """Optuna's objective over this kernel's training cell: ``study.optimize(nbddp.objective(space), n_trials=N)``.

    ``space``: ``trial → {name: value}`` (``trial.suggest_*``); each value overrides that name for the trial as ``-p``
    does. ``metric``: what rank 0 logs with ``nbddp.log`` (reported to the trial as it is logged, for its pruner; the
    trial's value is its last; several names: a multi-objective study's). ``cell``: the training code (default: the
    last ``%%ddp_train`` cell's); ``options``: its ``%%ddp_train`` line (default: that cell's); ``notebook``: a
    notebook's training cells instead. ``value``: the trial's value from the run's result, instead of the metric.

    Raises:
        UsageError: no training cell; a name of the space the code doesn't read; Optuna missing.
    """
    from IPython import get_ipython

    shell = get_ipython()
    if notebook is not None:
        from nbddp.notebook.reader import read_notebook

        launch = train_launch(options or "")
        trials: Any = NotebookTrials(read_notebook(Path(notebook)), launch, kernel_pool, owner="kernel",
                                     command=f"nbddp.objective(notebook={str(notebook)!r})")
    else:
        if shell is None:
            raise UsageError(NO_KERNEL)
        trials = KernelTrials(shell, _magics(shell), cell, options)
    return Objective(trials, space, metric, StudyView(shell, metric), value)


def _magics(shell: InteractiveShell) -> DdpMagics:
    magics = shell.magics_manager.registry.get("DdpMagics")
    if magics is None:
        raise UsageError("nbddp.objective runs the kernel's training cell: load the extension (%load_ext nbddp) and "
                         "run a %%ddp_train cell first")
    return magics


def train_launch(line: str) -> LaunchOptions:
    """The launch options of a ``%%ddp_train`` line (what a trial runs with; ``--fresh``, ``--detach`` and the
    others that are the cell's, not the run's, are left out)."""
    from nbddp.doors.jupyter.magics import launch_of

    return launch_of(line)


class KernelTrials:
    """The kernel's training cell as a study's trials: the script a ``%%ddp_train`` cell would make (the kernel's
    ``#| ddp`` cells, the cell, the values it takes from the kernel), each trial's values as ``-p`` overrides."""

    def __init__(self, shell: InteractiveShell, magics: DdpMagics, cell: str | None, line: str | None) -> None:
        if cell is None and magics.last_train is None:
            raise UsageError(NO_TRAINING_CELL)
        last_line, last_body = magics.last_train or ("", "")
        self.shell, self.magics = shell, magics
        self.body = cell if cell is not None else last_body
        self.line = line if line is not None else last_line
        self.launch = train_launch(self.line)
        self.runs = session_notebook(Path.cwd(), shell.user_ns).resolve().parent / "runs"

    #: The ``-p`` values of the cell's line are that cell's own defaults: a trial's values override them, as they
    #: override the kernel's, so a space may search them.
    fixed: tuple[str, ...] = ()

    def takes(self) -> tuple[str, ...]:
        _, values = build_script(self.magics.history, self.body, self.shell.user_ns,
                                 replace(self.launch, parameters={}), self.shell.execution_count)
        return tuple(values)

    def run(self, values: dict[str, Any], run_dir: Path, sinks: Sequence[Sink], heartbeat: Callable[[], Any],
            say: Callable[[str], None]) -> orchestrator.RunResult:
        launch = replace(self.launch, parameters={**self.launch.parameters, **values}, run_dir=run_dir)
        script, parameters = build_script(self.magics.history, self.body, self.shell.user_ns, launch,
                                          self.shell.execution_count)
        cwd = Path.cwd()
        request = orchestrator.RunRequest(
            script, launch, session_notebook(cwd, self.shell.user_ns), cwd, parameters,
            {k: v for k, v in parameters.items() if k in launch.parameters}, "nbddp.objective",
            source="the kernel", owner="kernel", warm=kernel_pool, said=self.magics.said)
        return orchestrator.run(request, orchestrator.NoKernel(), sinks, say, heartbeat=heartbeat)


class StudyView:
    """The study in the cell's output: a line per trial as it ends, the running trial's line, and two plots (the
    study's best value by trial, the running trial's metric by step), redrawn at most every
    :data:`REDRAW_SECONDS` while a trial runs. Outside a kernel (IPython in a terminal) the lines only."""

    def __init__(self, shell: InteractiveShell | None, metric: str | Sequence[str]) -> None:
        self.live = shell is not None and getattr(shell, "kernel", None) is not None
        self.metric = metric if isinstance(metric, str) else metric[0]
        self.lines: list[str] = []
        self.running = ""
        self.best: list[dict[str, float]] = []
        self.curve: list[dict[str, Any]] = []
        self.handle: Any = None
        self.drawn = 0.0
        self.started = 0.0

    def trial_started(self, number: int, params: dict[str, Any]) -> None:
        self.running = f"trial {number} · {params_text(params)} · running"
        self.curve, self.started = [], time.monotonic()
        self._draw(force=True)

    def event(self, event: Event) -> None:
        if isinstance(event, MetricsEvent) and self.metric in event.values:  # (the plot's x: the record's step)
            self.curve.append({"epoch": step_of(event.values, len(self.curve)), self.metric: event.values[self.metric]})
            self._draw()

    def heartbeat(self) -> None:
        self._draw()

    def say(self, line: str) -> None:
        print(f"[nbddp] {line}", flush=True)

    def trial_ended(self, end: TrialEnd, best: float | None) -> None:
        self.lines.append(end.line() + (f" · best {best:.6g}" if best is not None else ""))
        if best is not None:
            self.best.append({"epoch": end.number, f"best {self.metric}": best})
        self.running = ""
        if not self.live:
            print(f"[nbddp] {self.lines[-1]}", flush=True)
        self._draw(force=True)

    def _draw(self, force: bool = False) -> None:
        if not self.live or (not force and time.monotonic() - self.drawn < REDRAW_SECONDS):
            return
        from IPython.display import display

        self.drawn = time.monotonic()
        shown = _Drawing(self)
        if self.handle is None:
            self.handle = display(shown, display_id=True)
        else:
            self.handle.update(shown)


class _Drawing:
    """One drawing of a :class:`StudyView`: HTML for front ends, the lines as text for the others (papermill's
    executed notebook keeps both)."""

    def __init__(self, view: StudyView) -> None:
        running = f"{view.running} {time.monotonic() - view.started:.0f} s" if view.running else ""
        self.lines = [*view.lines, *([running] if running else [])]
        self.best = svg_plot(view.best, 360, 200, x_name="trial") if len(view.best) > 1 else ""
        self.curve = svg_plot(view.curve, 360, 200, x_name="the running trial's steps") if view.curve else ""

    def __repr__(self) -> str:
        return "\n".join(self.lines)

    def _repr_html_(self) -> str:
        rows = "".join(f"<div>{html.escape(line)}</div>" for line in self.lines)
        plots = "".join(f'<div style="flex:1;min-width:240px;max-width:420px">{svg}</div>'
                        for svg in (self.best, self.curve) if svg)
        return (f'<div class="nbddp-study"><div style="font-family:monospace;font-size:12px">{rows}</div>'
                f'<div style="display:flex;gap:12px">{plots}</div></div>')
