"""``nbddp run NOTEBOOK`` and ``nbddp.run(notebook)``: the notebook top to bottom in a kernel, its
training cells as a DDP job.

The door reads the notebook and writes its script (everything that can be checked is checked
before anything starts), then hands the run to :func:`nbddp.job.orchestrator.run` with the
notebook's kernel beside the job (:class:`~nbddp.doors.notebook_kernel.NotebookKernel`), and
writes the executed notebook. Nodes 1 and up of a multi-node run run no kernel.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from nbddp.display.ending import NO_WEIGHTS, ending_of, shown_path
from nbddp.display.starting import describe
from nbddp.display.terminal import NotebookOutputSink, TerminalSink
from nbddp.doors.notebook_kernel import NotebookKernel, kernel_for, kernel_notebook
from nbddp.job import orchestrator
from nbddp.job.debugger import Console
from nbddp.job.follow import Sink
from nbddp.launchers import batch_slot
from nbddp.contracts.status import Status
from nbddp.notebook.reader import Notebook, read_notebook
from nbddp.notebook.script import generate
from nbddp.plan.options import LaunchOptions

if TYPE_CHECKING:
    from nbformat import NotebookNode

    from nbddp.job.lifecycle import Job


@dataclass(frozen=True)
class RunOptions:
    notebook: Path
    launch: LaunchOptions = LaunchOptions()
    output: Path | None = None
    """The executed notebook (default: ``RUN_DIR/output.ipynb``), saved after every cell."""
    command: str = ""
    """How the run was started, for ``result.json``."""
    owner: str = "cli"
    """Who stops the job when ``nbddp kill`` asks (:attr:`nbddp.job.orchestrator.RunRequest.owner`)."""
    console: Console | None = None
    """Where a rank's debugger is relayed (:attr:`nbddp.job.orchestrator.RunRequest.console`): the terminal."""
    debug_on_failure: bool = False
    """``--debug-on-failure``: a rank that raises opens a post-mortem in :attr:`console`."""
    raw_output: bool = False
    """``--raw-output``: the ranks' lines reach the terminal as they are, control sequences too
    (:func:`nbddp.display.terminal.terminal_safe` otherwise)."""


def run_notebook(options: RunOptions, sinks: Sequence[Sink] | None = None, say: Callable[[str], None] | None = None,
                 notebook: Notebook | None = None,
                 on_start: Callable[[Any], Any] | None = None) -> orchestrator.RunResult:
    """Run the notebook; returns the result (never raises for a failed *run*, only for bad input).

    ``sinks``: where rank output goes (default: this terminal); ``notebook``: already read;
    ``on_start(job)``: once the ranks are starting (a detached run's supervisor tells its attachers).
    The result's ``extra`` holds ``output`` (the executed notebook's path) and ``executed`` (the node).
    """
    terminal = TerminalSink(raw=options.raw_output) if sinks is None else None
    shown = list(sinks) if terminal is None else [terminal]
    say = say or _stderr
    if terminal is not None:
        say = terminal.above(say)  # nbddp's lines above the epoch bar, never through it
    try:
        launch = options.launch
        export = launch.export_options()
        notebook = notebook or read_notebook(options.notebook)
        script = generate(notebook, export, to_run=True)  # everything that can be checked, before anything starts
        request = orchestrator.RunRequest(
            script, launch, notebook.path, notebook.path.resolve().parent, script.parameters, dict(launch.parameters),
            options.command, owner=options.owner, warm=batch_slot(),
            console=options.console, debug_on_failure=options.debug_on_failure)
        if launch.nodes is not None and launch.nodes.rank != 0:
            return _other_node(request, shown, say, terminal, on_start)
        return _node_zero(request, notebook, options.output, shown, say, terminal, on_start)
    finally:
        if terminal is not None:
            terminal.close()


def check_notebook(options: RunOptions) -> None:
    """Everything about a run that can be checked before it starts (the notebook, its script, the devices):
    what a detached run checks in front of its user before a supervisor takes it.

    Raises:
        NotebookError, CellError, UsageError, DeviceError: what :func:`run_notebook` would raise first.
    """
    from nbddp.launchers import devices_for

    export = options.launch.export_options()
    notebook = read_notebook(options.notebook)
    script = generate(notebook, export, to_run=True)
    devices_for(options.launch, asked=script.processes)
    if options.launch.nodes is None or options.launch.nodes.rank == 0:
        kernel_for(notebook)


def _node_zero(request: orchestrator.RunRequest, notebook: Notebook, output: Path | None, sinks: list[Sink],
               say: Callable[[str], None], terminal: TerminalSink | None,
               started: Callable[[Any], Any] | None) -> orchestrator.RunResult:
    """The notebook's kernel beside the job; the executed notebook written after every cell."""
    kernel_name = kernel_for(notebook)  # (a kernel not installed here: said before anything starts)
    executed, numbers = kernel_notebook(notebook, request.launch.parameters)
    collector = NotebookOutputSink()
    where: dict[str, Path] = {}

    def save(nb: NotebookNode) -> None:
        if "output" in where:
            write_notebook(nb, where["output"])

    def on_start(job: Job) -> None:
        collector.run_dir = job.run_dir
        where["output"] = Path(output or job.paths.output)
        say(f"nbddp: {describe(job.spec)}")
        if started is not None:
            started(job)

    kernel = NotebookKernel(executed, numbers, notebook, request.cwd, collector, [collector, *sinks],
                            request.script.training, save=save,
                            echo=terminal.line if terminal is not None else None,  # above the epoch bar
                            kernel_name=kernel_name)
    result = orchestrator.run(request, kernel, [collector, *sinks], _prefixed(say), on_start=on_start)
    out = where.get("output", Path(output or result.paths.output))
    ending = summary(result, out)
    write_notebook(executed, out)
    result.extra.update(output=out, executed=executed)
    _end_bar(terminal)
    say(ending)
    return result


def _end_bar(terminal: TerminalSink | None) -> None:
    """The epoch bar ends (once) before the run's ending, which then starts on a line of its own."""
    if terminal is not None:
        terminal.close()


def _other_node(request: orchestrator.RunRequest, sinks: list[Sink], say: Callable[[str], None],
                terminal: TerminalSink | None, started: Callable[[Any], Any] | None) -> orchestrator.RunResult:
    """Node 1 and up of a multi-node run: only this node's ranks (node 0 runs the kernel, gets the weights)."""
    nodes = request.launch.nodes

    def on_start(job: Job) -> None:
        say(f"nbddp: node {nodes.rank} of {nodes.count}: {describe(job.spec)}")
        if started is not None:
            started(job)

    result = orchestrator.run(request, orchestrator.NoKernel("node 0 holds the weights"), sinks, _prefixed(say),
                              on_start=on_start)
    line = f"nbddp: node {nodes.rank}: {ending_of(result).line()}"
    _end_bar(terminal)
    say(f"nbddp: error: {result.message}\n{line}" if result.message else line)
    return result


def write_notebook(nb: NotebookNode, path: Path) -> None:
    """Write atomically: a kill mid-write leaves the previous save."""
    import nbformat

    from nbddp.contracts.atomic import replace_atomically

    replace_atomically(path, lambda tmp: nbformat.write(nb, tmp))


def summary(result: orchestrator.RunResult, output: Path) -> str:
    """The run's ending: its error (if any), then one line, then the final metrics."""
    weights = result.paths.weights
    ending = replace(ending_of(result), weights=f"weights {shown_path(weights)}" if weights.exists()
                     else ending_of(result).weights if result.status == Status.SUCCEEDED else NO_WEIGHTS)
    lines = [f"nbddp: error: {result.message}"] if result.message else []
    lines.append(f"nbddp: {ending.line()} · notebook {shown_path(output)}")
    if ending.metrics_line():
        lines.append(f"nbddp: {ending.metrics_line()}")
    return "\n".join(lines)


def _prefixed(say: Callable[[str], None]) -> Callable[[str], None]:
    return lambda text: say(f"nbddp: {text}")


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
