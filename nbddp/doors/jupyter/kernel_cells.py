"""The ``%%ddp_train`` job, run from inside a kernel: the core behind the magic.

The script is made of the ``#| ddp`` cells this kernel has executed (the
latest version of each, tracked by the cell id the front end sends) and the
body of the ``%%ddp_train`` cell. It never reads the notebook file, which may
be unsaved. Names the code uses but doesn't define come from the kernel when
they are plain data (papermill's injected parameters, values computed in
untagged cells); anything else is refused before launch.

Nothing here imports IPython or ipywidgets: :mod:`nbddp.doors.jupyter` is the shell.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

from nbddp.notebook.cells import SETUP, TRAIN, cell_role, export_cell
from nbddp.checkpoint import load_into, load_returns
from nbddp.devices import Devices
from nbddp.launchers import devices_for
from nbddp.errors import CellError, ParameterError
from nbddp.notebook.freevars import free_names
from nbddp.job.lifecycle import Job, JobOutcome, deadline_of, job_spec
from nbddp.job.outcome import Status, run_error
from nbddp.notebook.reader import Cell
from nbddp.options import LaunchOptions
from nbddp.notebook.literals import is_plain_data
from nbddp.job.record import RunRecord
from nbddp.notebook.script import ExportOptions, Script, render
from nbddp.job.follow import Sink

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


@dataclass
class CellJobResult:
    status: str
    run_dir: Path
    record: RunRecord
    loaded: list[str] = field(default_factory=list)
    note: str = ""

    def weights(self) -> str:
        """Where the weights went, for the ending line."""
        if self.loaded:
            return f"{', '.join(self.loaded)} loaded on the CPU" + (f" ({self.note})" if self.note else "")
        return self.note or "no weights came back"


def build_script(history: CellHistory, body: str, namespace: dict[str, Any], options: LaunchOptions,
                 execution_count: int | None = None) -> tuple[Script, dict[str, Any]]:
    """The script for one ``%%ddp_train`` cell, and the plain values written into it.

    Those values are the names the code uses but no ``#| ddp`` cell defines: taken from the kernel
    (papermill's injected parameters, values from untagged cells), or from ``-p NAME VALUE``, which
    overrides the kernel's value of such a name.

    Raises:
        CellError: a syntax error or unexportable IPython syntax (naming ``In [N]``
            and the line), or a free name whose kernel value can't reach the ranks.
        ParameterError: a ``-p`` name the training code doesn't take from the kernel.
    """
    origin = "the kernel"
    exported = [export_cell(cell, SETUP, origin) for cell in history.cells()]
    train = Cell(execution_count or 0, "code", body, (), None, label=TRAIN_LABEL)
    exported.append(export_cell(train, TRAIN, origin))
    export = ExportOptions(engine=options.engine, returns=options.returns, parameters_source="values in the kernel")
    first = render(exported, origin, export)
    free = free_names(first.text)
    unknown = sorted(set(options.parameters) - set(free))
    if unknown:
        raise ParameterError(
            f"-p {', '.join(unknown)}: the training code takes no such value from the kernel"
            + (f"; it takes {', '.join(free)}." if free else " (it defines everything it uses in '#| ddp' cells)."))
    values = {name: options.parameters[name] if name in options.parameters else _kernel_value(name, namespace)
              for name in free}
    if not values:
        return first, values
    script = render(exported, origin, replace(export, parameters=values))
    return script, values


def _kernel_value(name: str, namespace: dict[str, Any]) -> Any:
    if name in namespace and is_plain_data(namespace[name]):
        return namespace[name]
    if name in namespace:
        raise CellError(
            f"{name!r} is a {type(namespace[name]).__name__} in the kernel; the ranks only receive plain "
            f"values (numbers, strings, lists, dicts…). Move the code that defines {name!r} into a "
            "'#| ddp' cell (so every rank builds it too) and run that cell again."
        )
    raise CellError(
        f"the training code uses {name!r}, which no '#| ddp' cell run so far defines and the kernel "
        f"doesn't have. Define it in a '#| ddp' cell and run that cell first."
    )


def run_cell_job(script: Script, parameters: dict[str, Any], options: LaunchOptions, namespace: dict[str, Any],
                 sinks: Sequence[Sink], cwd: Path | None = None, say=print, command: str = "",
                 on_start: Callable[[Path, range], Any] | None = None,
                 heartbeat: Callable[[], Any] | None = None, warm: bool = False,
                 warm_idle: float = 600.0) -> CellJobResult:
    """Launch the job, stream it to ``sinks``, load the returned weights into ``namespace``.

    ``on_start(run_dir, ranks)`` is called once the ranks are starting (a view appears then);
    ``heartbeat`` on every poll while they run: whatever it raises stops the job (a
    ``KeyboardInterrupt`` is recorded as an interruption). ``warm``: run on the kernel's warm ranks
    (:mod:`nbddp.launchers.warm_pool`), started on first use, kept while runs succeed.

    Raises:
        DeviceError: before anything starts.
        RunFailed / RunTimeout / RunInterrupted: the job didn't succeed; the exception carries the
            judged outcome and its message names the cell and line.
        KeyboardInterrupt: re-raised after every rank is stopped (the run is recorded as interrupted).
    """
    devices: Devices = devices_for(options)
    if devices.note:
        say(f"[nbddp] {devices.note}")
    from nbddp.doors.notebook_run import topology_notes

    for note in topology_notes(options):
        say(note.replace("nbddp: ", "[nbddp] ", 1))
    cwd = Path(cwd or os.getcwd())
    pool = None
    if warm:
        from nbddp.launchers import warm_pool

        pool, note = warm_pool.acquire(devices, script.engine, cwd, options.collective_timeout,
                                       multi_node=options.nodes is not None or options.slurm is not None,
                                       restarts=options.max_restarts, idle=warm_idle)
        if note:
            say(f"[nbddp] {note}")
    stem = Path(os.environ.get("JPY_SESSION_NAME") or "ddp_train").stem  # set by jupyter-server; never read
    spec = job_spec(script, options, devices, cwd / f"{stem}.ipynb", cwd, owner="kernel", pool=pool)
    deadline = deadline_of(options)
    overrides = {k: v for k, v in parameters.items() if k in options.parameters}

    def record(job: Job, status: Status, code: int, message: str, outcome: JobOutcome | None) -> RunRecord:
        return job.record(status, code, message, outcome, parameters, "the kernel", overrides, command)

    with Job.start(spec) as job:
        try:
            if on_start is not None:
                on_start(job.run_dir, job.local_ranks())
            outcome = job.wait(sinks, deadline, options.idle_timeout, heartbeat)  # stops every rank first
        except KeyboardInterrupt:  # the kernel's stop button
            record(job, Status.INTERRUPTED, 130, "interrupted", job.outcome(interrupted_by=signal.SIGINT))
            _retire(pool, "the last run was interrupted")
            raise
        except Exception as exc:
            record(job, Status.FAILED, 1, f"{type(exc).__name__}: {exc}", None)
            _retire(pool, "the last run failed")
            raise
    if outcome.status != Status.SUCCEEDED:
        record(job, outcome.status, outcome.exit_code, outcome.message, outcome)
        _retire(pool, "the last run timed out" if outcome.status == Status.TIMEOUT else f"the last run {outcome.status}")
        raise run_error(outcome, job.paths)
    if options.nodes is not None and options.nodes.rank != 0:  # node 0's kernel gets the weights
        record_ = record(job, Status.SUCCEEDED, 0, "", outcome)
        return CellJobResult(Status.SUCCEEDED, job.run_dir, record_, [], f"node {options.nodes.rank}: node 0 holds the weights")
    states, note = load_returns(job.checkpoint)
    loaded = load_into(namespace, states)
    return CellJobResult(Status.SUCCEEDED, job.run_dir, record(job, Status.SUCCEEDED, 0, "", outcome), loaded, note)


def _retire(pool: Any, reason: str) -> None:
    """A run on warm ranks that didn't succeed: their state is suspect, the next run starts fresh ones."""
    if pool is not None:
        from nbddp.launchers import warm_pool

        warm_pool.retire(reason)
