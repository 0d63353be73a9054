"""``papermill --engine nbddp NOTEBOOK OUT -p NAME VALUE``: papermill runs the notebook the nbddp way.

Registered through papermill's ``papermill.engine`` entry point, so anything that drives papermill
(Airflow's PapermillOperator, Dagster, Ploomber) gets DDP with no change. The engine behaves as
papermill's own engine does, with one difference: the ``ddp-train`` cells run as a DDP job
(:func:`nbddp.job.orchestrator.run`), every other cell in papermill's own client; in a notebook with no
cell marked, the cell that launches Accelerate's, Lightning's or the Hugging Face Trainer's training is
that cell, with the cells it needs as its setup (:mod:`nbddp.notebook.unmarked`). So papermill's
options mean what they mean (``-k``, ``--cwd``, ``--execution-timeout`` per cell, ``--log-output``,
``--stdout-file``/``--stderr-file``, ``--request-save-on-cell-execute``, ``--report-mode``), its
bookkeeping marks the cells, and a failed, timed-out or interrupted (``nbddp kill``) run is a
``PapermillExecutionError`` at the training cell, the kernel having raised
:class:`~nbddp.contracts.errors.RunFailed` (``RunTimeout``, ``RunInterrupted``) there. A notebook without a
training cell runs exactly as papermill runs it. Ctrl-C stops every rank and propagates, as
it does with papermill's engine.

A ``-p`` name that the notebook's ``parameters`` cell doesn't define is injected with a warning, as
papermill does (pipelines pass one shared value, a run date say, to every notebook), the warning
naming the closest defined name; ``nbddp run`` and ``nbddp batch``, where the user typed the name,
refuse it.

A cell marked with the ``#| parameters`` directive is papermill's parameters cell: papermill finds
that cell by its tag alone, when it loads the notebook (before any engine is asked), so this module
has papermill's loader tag it (:func:`_read_parameters_directive`). It does so when papermill loads
its engines' entry points, which is when papermill imports this module; importing it before
papermill is a cycle through papermill's own start-up.

A refusal (``NBDDP_OPTIONS`` that can't work, a notebook that can't become a run) is one line on
papermill's command line, exit 1 as for a failed notebook, and a ``NbddpEngineError`` from Python.

Launch options come from ``NBDDP_OPTIONS`` (the flags of ``nbddp run``, e.g. ``--cpu --nproc 2``),
since papermill's command line has no place for them. The run dir goes under papermill's
working folder (``--cwd``).
"""

from __future__ import annotations

import functools
import os
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TextIO

import click
import papermill.iorw
from papermill.clientwrap import PapermillNotebookClient
from papermill.engines import Engine, NBClientEngine
from papermill.exceptions import PapermillException

from nbddp.display.ending import ending_of
from nbddp.display.starting import describe
from nbddp.display.terminal import NotebookOutputSink
from nbddp.doors.notebook_kernel import NotebookKernel, TrainingCells, kernel_environment
from nbddp.contracts.errors import CellSyntaxError, NbddpError, UsageError
from nbddp.job import orchestrator
from nbddp.job.orchestrator import KernelResult
from nbddp.contracts.status import Status
from nbddp.notebook.cells import INJECTED, PARAMETERS, directive, training_cells
from nbddp.notebook.parameters import closest_parameter, declared_parameters, type_notices
from nbddp.notebook.reader import Notebook, from_nbformat
from nbddp.notebook.script import Script, generate
from nbddp.plan.options import PAPERMILL, ArgumentParser, LaunchOptions, add_launch_arguments, launch_options

if TYPE_CHECKING:
    import logging

    from nbformat import NotebookNode
    from papermill.engines import NotebookExecutionManager

    from nbddp.job.lifecycle import Job

OPTIONS_VARIABLE = "NBDDP_OPTIONS"


class NbddpEngineError(PapermillException, click.ClickException):
    """``NBDDP_OPTIONS``, or the notebook, can't make a DDP run (nothing ran, nothing was written).

    A ``click.ClickException`` too, so that papermill's command line (a click command) prints it as one
    ``Error: ...`` line and exits 1, the exit code of a failed notebook, instead of a traceback through
    papermill's and nbddp's frames."""

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, message)

    def __str__(self) -> str:
        return self.message

    def show(self, file: IO[Any] | None = None) -> None:
        """As ``nbddp run`` says a refusal."""
        click.echo(f"nbddp: error: {self.message}", file=file or sys.stderr)

    def __reduce__(self) -> tuple[Any, ...]:  # pickles as its message, as the other nbddp errors do
        return type(self), (self.message,)


def _read_parameters_directive() -> None:
    """Make papermill's notebook loader tag a ``#| parameters`` cell ``parameters``.

    papermill looks for the tag when it checks ``-p`` names and places the injected cell, both before it
    asks the engine anything, so without the tag it warns ``Passed unknown parameter``, injects the values
    at the top, and the directive cell then sets the defaults back: a run with the defaults, exit 0. The
    tag is added to the loaded notebook only (the file is never written), whatever the engine, since the
    directive means the same everywhere; a cell already tagged, or a second such cell, is left alone.
    """
    original = papermill.iorw.load_notebook_node
    if getattr(original, "reads_parameters_directive", False):
        return

    @functools.wraps(original)
    def load_notebook_node(notebook_path: str) -> NotebookNode:
        nb = original(notebook_path)
        tag_parameters_directive(nb)
        return nb

    load_notebook_node.reads_parameters_directive = True  # type: ignore[attr-defined]
    # papermill.execute and papermill.inspection bind the loader by name after their engines are loaded
    # (this module is one); rebind it where an earlier import already bound the original.
    for module in (papermill.iorw, sys.modules.get("papermill.execute"), sys.modules.get("papermill.inspection")):
        if module is not None and getattr(module, "load_notebook_node", None) is original:
            module.load_notebook_node = load_notebook_node


def tag_parameters_directive(nb: NotebookNode) -> None:
    """Tag the first ``#| parameters`` cell ``parameters``, unless a cell already has the tag."""
    code_cells = [cell for cell in nb.cells if cell.get("cell_type") == "code"]
    if any(PARAMETERS in (cell.get("metadata", {}).get("tags") or ()) for cell in code_cells):
        return
    for cell in code_cells:
        if directive(cell.get("source", "")) == PARAMETERS:
            cell.setdefault("metadata", {})["tags"] = [*(cell["metadata"].get("tags") or ()), PARAMETERS]
            return


_read_parameters_directive()


@dataclass(frozen=True)
class _Plan:
    """What was checked before papermill starts anything: the script and the run's request."""

    notebook: Notebook
    launch: LaunchOptions
    script: Script
    request: orchestrator.RunRequest


class NbddpEngine(Engine):
    """papermill's engine, with the ``ddp-train`` cells run as a DDP job."""

    @classmethod
    def execute_notebook(cls, nb: NotebookNode, kernel_name: str, **kwargs: Any) -> NotebookNode:
        """Check everything first (a refusal writes nothing), then let papermill run the notebook."""
        try:  # a directive nbddp doesn't know (#| ddp-trian), NBDDP_OPTIONS it can't honour
            notebook = from_nbformat(nb, _notebook_name(kwargs.get("input_path")))
            training = training_cells(notebook, _asked_options().train_cell)
        except NbddpError as exc:
            raise NbddpEngineError(str(exc)) from None
        if not training:
            return NBClientEngine.execute_notebook(nb, kernel_name, **kwargs)  # nothing to train: papermill's own
        try:
            plan = _plan(nb, kwargs.get("input_path"))
        except CellSyntaxError as exc:
            if exc.cell is None or exc.cell > training[0]:
                raise NbddpEngineError(str(exc)) from None
            # The kernel stops at that cell as it would with papermill's engine, before any training:
            # papermill runs it, and reports the SyntaxError where it is.
            return NBClientEngine.execute_notebook(nb, kernel_name, **kwargs)
        return super().execute_notebook(nb, kernel_name, nbddp_plan=plan, **kwargs)

    @classmethod
    def execute_managed_notebook(cls, nb_man: NotebookExecutionManager, kernel_name: str, log_output: bool = False,
                                 stdout_file: TextIO | None = None, stderr_file: TextIO | None = None,
                                 start_timeout: float = 60, execution_timeout: float | None = None,
                                 nbddp_plan: _Plan | None = None, **kwargs: Any) -> NotebookNode:
        plan = nbddp_plan or _plan(nb_man.nb, kwargs.get("input_path"))
        kwargs.pop("input_path", None)
        timeout = execution_timeout or kwargs.pop("timeout", None)
        kwargs.pop("startup_timeout", None)
        collector = NotebookOutputSink()
        kernel = PapermillKernel(nb_man, plan.notebook, collector, plan.script.training, timeout,
                                 dict(kwargs, kernel_name=kernel_name, startup_timeout=start_timeout,
                                      log_output=log_output, stdout_file=stdout_file, stderr_file=stderr_file))

        def on_start(job: Job) -> None:
            collector.run_dir = job.run_dir
            _say(describe(job.spec))

        result = orchestrator.run(plan.request, kernel, [collector], _say, on_start=on_start)
        _say(ending_of(result).line())
        if result.interrupted_by is not None:
            raise KeyboardInterrupt  # as papermill's engine: Ctrl-C ends papermill, not only this cell
        if kernel.timeout_error is not None:
            raise kernel.timeout_error  # a kernel cell's --execution-timeout: nbclient's own error, as papermill
        return nb_man.nb


class _Client(TrainingCells, PapermillNotebookClient):
    """papermill's client (its cell loop, bookkeeping, logging, autosave), receiving the training cells."""

    def on_rank_lines(self, text: str) -> None:
        from nbformat.v4 import new_output

        if self.log_output or self.stdout_file:
            self.log_output_message(new_output("stream", name="stdout", text=text))
        if threading.current_thread() is threading.main_thread():  # (not while the kernel runs a cell)
            self.nb_man.autosave_cell()


class PapermillKernel(NotebookKernel):
    """The notebook's cells in papermill's client, beside the job."""

    def __init__(self, nb_man: NotebookExecutionManager, notebook: Notebook, collector: NotebookOutputSink,
                 training: tuple[int, ...], timeout: float | None, client_options: dict[str, Any]) -> None:
        numbers = list(range(1, len(nb_man.nb.cells) + 1))  # papermill's notebook: its cells, as they are
        super().__init__(nb_man.nb, numbers, notebook, Path.cwd(), collector, [collector], training)
        self.nb_man, self.timeout, self.client_options = nb_man, timeout, client_options
        self.timeout_error: BaseException | None = None

    def execute(self, deadline: float | None) -> KernelResult:
        from nbclient.exceptions import CellTimeoutError

        options = dict(self.client_options)
        client = _Client(self.nb_man, km=self.kernel_manager(options["kernel_name"]), timeout=self.timeout,
                         log=_logger(), **options)
        client.nbddp_kernel = self
        try:
            # papermill's loop: a failing cell is marked and ends it, without raising. (nbclient shuts down only
            # a kernel whose manager it made itself unless told to: this one's is ours, for its IPC sockets.)
            client.execute(cleanup_kc=True, env=kernel_environment())
        except CellTimeoutError as exc:
            self.timeout_error = exc
            return KernelResult.failed(str(exc).strip().splitlines()[0], Status.TIMEOUT, error=exc)
        for index, cell in enumerate(self.nb.cells):
            if cell.get("metadata", {}).get("papermill", {}).get("status") == "failed":
                error = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), {})
                return self.failed_cell(index, error.get("ename", "CellExecutionError"), error.get("evalue", ""),
                                        "\n".join(error.get("traceback", [])))
        return KernelResult(loaded=list(self.loaded))

    def training_deadline(self) -> tuple[float | None, str | None]:
        if not self.timeout:
            return None, None
        return time.monotonic() + self.timeout, f"papermill's --execution-timeout ({self.timeout:g}s)"

    def on_training_start(self, cell: NotebookNode, index: int) -> None:
        self.nb_man.save()


def options_parser() -> ArgumentParser:
    """What ``NBDDP_OPTIONS`` may say: the launch options this door takes."""
    parser = ArgumentParser(prog=OPTIONS_VARIABLE)
    add_launch_arguments(parser, PAPERMILL)
    return parser


def _asked_options() -> LaunchOptions:
    """The launch options ``NBDDP_OPTIONS`` holds.

    Raises:
        UsageError: it holds what ``nbddp run`` wouldn't take, said as about ``NBDDP_OPTIONS``.
    """
    text = os.environ.get(OPTIONS_VARIABLE, "")
    try:
        return launch_options(options_parser().parse_args(shlex.split(text)))
    except UsageError as exc:
        raise UsageError(f"{OPTIONS_VARIABLE}={text!r}: {_without_help_hint(str(exc))} {OPTIONS_VARIABLE} "
                         "takes the launch options of `nbddp run` (`nbddp run --help` lists them).") from None


def _plan(nb: NotebookNode, input_path: Any) -> _Plan:
    """The DDP run of papermill's parameterized notebook, checked: its options, names and script.

    Raises:
        NbddpEngineError: ``NBDDP_OPTIONS`` can't be honoured, or the notebook can't become a run.
    """
    path = _notebook_name(input_path)  # in papermill's working folder (--cwd): the run dir goes beside it
    name = path.name
    try:
        launch = _asked_options()
        notebook = from_nbformat(nb, path)
        injected = declared_parameters(notebook, roles=(INJECTED,))  # what papermill's -p put in its cell
        _warn_unknown(notebook, injected)  # (first: a misspelt -p may be why a name is undefined below)
        script = generate(notebook, launch.export_options(), to_run=True)
    except CellSyntaxError:
        raise
    except NbddpError as exc:
        raise NbddpEngineError(str(exc)) from None
    overrides = {**injected, **launch.parameters}
    request = orchestrator.RunRequest(
        script, launch, path, Path.cwd(), script.parameters, overrides,
        f"papermill --engine nbddp {name}" + "".join(f" -p {k} {v!r}" for k, v in overrides.items()),
        owner="kernel")
    return _Plan(notebook, launch, script, request)


def _warn_unknown(notebook: Notebook, injected: dict[str, Any]) -> None:
    """A ``-p`` name the parameters cell doesn't define is injected anyway, as papermill's engine does (a
    scheduler may pass one shared value to every notebook); the warning names the closest defined name,
    since a typo trains with the default."""
    declared = declared_parameters(notebook, roles=(PARAMETERS,))
    for name in sorted(set(injected) - set(declared)):
        closest = closest_parameter(name, declared)
        hint = f"did you mean {closest}? " if closest else ""
        where = "the parameters cell doesn't define it" if declared else "the notebook has no parameters cell"
        _logger().warning(f"nbddp: -p {name}: {where} ({hint}injected anyway, as papermill does; the training "
                          f"uses it only if the code reads {name}).")
    for notice in type_notices(declared, injected):
        _logger().warning(f"nbddp: {notice}")


def _notebook_name(input_path: Any) -> Path:
    """How messages name papermill's input notebook (its file name; the run dir is named after it)."""
    return Path(Path(str(input_path or "notebook.ipynb")).name)


def _without_help_hint(message: str) -> str:
    return message.replace(f" See {OPTIONS_VARIABLE} --help.", "").rstrip()


def _logger() -> logging.Logger:
    from papermill.log import logger

    return logger


def _say(text: str) -> None:
    for line in text.splitlines():
        _logger().info(f"nbddp: {line}")
