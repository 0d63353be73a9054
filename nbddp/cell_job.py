"""The ``%%ddp_train`` job, run from inside a kernel: the core behind the magic.

The script is made of the ``#| ddp`` cells this kernel has executed (the
latest version of each, tracked by the cell id the front end sends) and the
body of the ``%%ddp_train`` cell. It never reads the notebook file, which may
be unsaved. Names the code uses but doesn't define come from the kernel when
they are plain data (papermill's injected parameters, values computed in
untagged cells); anything else is refused before launch.

Nothing here imports IPython or ipywidgets: :mod:`nbddp.jupyter` is the shell.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable, Sequence

from nbddp.cells import SETUP, TRAIN, cell_role, export_cell
from nbddp.checkpoint import load_into, load_returns
from nbddp.devices import Devices, resolve
from nbddp.errors import CellError, RunFailed, RunInterrupted, RunTimeout
from nbddp.freevars import free_names
from nbddp.job import DEFAULT_COLLECTIVE_TIMEOUT, Job, JobOutcome, create_run_dir
from nbddp.notebook import Cell
from nbddp.parameters import is_plain_data
from nbddp.report import RunRecord
from nbddp.script import ExportOptions, Script, render
from nbddp.stream import Sink

TRAIN_LABEL = "the %%ddp_train cell"


class CellHistory:
    """The ``#| ddp`` cells executed in this kernel, latest version of each, in first-run order.

    Cells are tracked by the id the front end sends with each execution
    (JupyterLab, Notebook 7, VS Code do). Without ids, executions are kept in
    execution order, an unchanged re-run replacing its earlier copy.
    """

    def __init__(self) -> None:
        self._cells: dict[Hashable, Cell] = {}

    def record(self, source: str, cell_id: str | None = None, tags: Sequence[str] = (),
               execution_count: int | None = None) -> None:
        count = execution_count or 0
        cell = Cell(count, "code", source, tuple(tags), cell_id, label=f"In [{count}]")
        key: Hashable = ("id", cell_id) if cell_id else ("source", source)
        try:
            role = cell_role(cell, "the kernel")
        except CellError:
            role = None  # the magic reports bad directives when it exports
        if role == SETUP:
            self._cells[key] = cell  # an existing key keeps its place, with the new source
        else:
            self._cells.pop(key, None)  # a cell edited to no longer be `#| ddp` leaves the script

    def cells(self) -> list[Cell]:
        return list(self._cells.values())


@dataclass(frozen=True)
class CellJobOptions:
    """``%%ddp_train`` arguments, parsed once by the magic."""

    engine: str | None = None
    returns: tuple[str, ...] = ("model",)
    gpus: str | None = None
    cpu: bool = False
    nproc: int | None = None
    run_dir: Path | None = None
    timeout: float | None = None
    dry_run: bool = False
    collective_timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT
    idle_timeout: float | None = None


@dataclass
class CellJobResult:
    status: str
    run_dir: Path
    record: RunRecord
    loaded: list[str] = field(default_factory=list)
    note: str = ""

    def summary(self) -> str:
        r = self.record
        from nbddp.stream import format_metrics

        lines = [f"[nbddp] {r.status} in {r.wall_time_s:.1f}s: world size {r.world_size} on "
                 f"{r.devices['nproc']} {'GPU(s)' if r.devices['kind'] == 'cuda' else 'CPU processes (gloo)'}, "
                 f"{r.engine} engine"]
        if self.loaded:
            lines.append(f"[nbddp] loaded the trained {', '.join(self.loaded)} on the CPU" + (f" ({self.note})" if self.note else ""))
        if r.final_metrics:
            lines.append(f"[nbddp] final metrics: {format_metrics(r.final_metrics)}")
        lines.append(f"[nbddp] run dir: {self.run_dir}")
        return "\n".join(lines)


def build_script(history: CellHistory, body: str, namespace: dict[str, Any], options: CellJobOptions,
                 execution_count: int | None = None) -> tuple[Script, dict[str, Any]]:
    """The script for one ``%%ddp_train`` cell, and the kernel's plain values written into it.

    Raises:
        CellError: a syntax error or unexportable IPython syntax (naming ``In [N]``
            and the line), or a free name whose kernel value can't reach the ranks.
    """
    origin = "the kernel"
    exported = [export_cell(cell, SETUP, origin) for cell in history.cells()]
    train = Cell(execution_count or 0, "code", body, (), None, label=TRAIN_LABEL)
    exported.append(export_cell(train, TRAIN, origin))
    export = ExportOptions(engine=options.engine, returns=options.returns, parameters_source="values in the kernel")
    first = render(exported, origin, export)
    values = {}
    for name in free_names(first.text):
        if name in namespace and is_plain_data(namespace[name]):
            values[name] = namespace[name]
        elif name in namespace:
            raise CellError(
                f"{name!r} is a {type(namespace[name]).__name__} in the kernel; the ranks only receive plain "
                f"values (numbers, strings, lists, dicts…). Move the code that defines {name!r} into a "
                "'#| ddp' cell (so every rank builds it too) and run that cell again."
            )
        else:
            raise CellError(
                f"the training code uses {name!r}, which no '#| ddp' cell run so far defines and the kernel "
                f"doesn't have. Define it in a '#| ddp' cell and run that cell first."
            )
    if not values:
        return first, values
    script = render(exported, origin, ExportOptions(engine=options.engine, returns=options.returns,
                                                    parameters=values, parameters_source="values in the kernel"))
    return script, values


def run_cell_job(script: Script, parameters: dict[str, Any], options: CellJobOptions, namespace: dict[str, Any],
                 sinks: Sequence[Sink], cwd: Path | None = None, say=print) -> CellJobResult:
    """Launch the job, stream it to ``sinks``, load the returned weights into ``namespace``.

    Raises:
        DeviceError: before anything starts.
        RunFailed / RunTimeout: the job failed; the message names the cell and line.
        KeyboardInterrupt: re-raised after every rank is stopped (the run is recorded as interrupted).
    """
    devices: Devices = resolve(options.gpus, options.cpu, options.nproc)
    if devices.note:
        say(f"[nbddp] {devices.note}")
    cwd = Path(cwd or os.getcwd())
    stem = Path(os.environ.get("JPY_SESSION_NAME") or "ddp_train").stem  # set by jupyter-server; never read
    run_dir = create_run_dir(cwd / f"{stem}.ipynb", options.run_dir)
    deadline = time.monotonic() + options.timeout if options.timeout else None
    with Job(script, devices, run_dir, cwd, collective_timeout=options.collective_timeout, owner="kernel") as job:
        try:
            outcome = job.wait(sinks, deadline, options.idle_timeout)  # stops every rank before anything propagates
        except KeyboardInterrupt:  # the kernel's stop button
            job.record("interrupted", 130, "interrupted", job.outcome(interrupted_by=2), parameters, "the kernel")
            raise
        except Exception as exc:
            job.record("failed", 1, f"{type(exc).__name__}: {exc}", None, parameters, "the kernel")
            raise
    return _finish(job, outcome, namespace, parameters)


def _finish(job: Job, outcome: JobOutcome, namespace: dict[str, Any], parameters: dict[str, Any]) -> CellJobResult:
    if outcome.status != "succeeded":
        job.record(outcome.status, outcome.exit_code, outcome.message, outcome, parameters, "the kernel")
        error = {"timeout": RunTimeout, "interrupted": RunInterrupted}.get(outcome.status, RunFailed)
        raise error(outcome.message)
    states, note = load_returns(job.checkpoint)
    loaded = load_into(namespace, states)
    record = job.record("succeeded", 0, "", outcome, parameters, "the kernel")
    return CellJobResult("succeeded", job.run_dir, record, loaded, note)
