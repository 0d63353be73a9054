"""``nbddp run``: the notebook top to bottom in a kernel, its training cells as a DDP job.

The orchestrator reads top to bottom: read → choose devices → generate the
script → launch the ranks → start the kernel (while the ranks start) → run the
cells before training → wait for the job, streaming every rank → load the
returned weights on the CPU → run the evaluation cells → write the executed
notebook and ``result.json``. Everything that can be checked is checked
before anything starts.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from nbddp.notebook.cells import INJECTED, PARAMETERS, TRAIN, cell_role
from nbddp.notebook.freevars import check_defined
from nbddp.job.lifecycle import Job, JobOutcome, JobSpec, deadline_of, job_spec
from nbddp.launchers import devices_for
from nbddp.notebook.reader import Notebook, read_notebook
from nbddp.job.outcome import Status, run_error
from nbddp.options import LaunchOptions
from nbddp.notebook.parameters import declared_parameters, effective_parameters
from nbddp.notebook.literals import assignments
from nbddp.launchers.process_groups import owned_temp_dir
from nbddp.job.record import RunRecord
from nbddp.job.rundir import RunDir
from nbddp.notebook.script import ExportOptions, generate
from nbddp.display.ending import NO_WEIGHTS, Ending, shown_path
from nbddp.job.follow import Sink
from nbddp.display.terminal import NotebookOutputSink, TerminalSink


class SignalReceived(BaseException):
    """Raised in the main thread by the CLI's SIGTERM/SIGHUP handlers (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@dataclass(frozen=True)
class RunOptions:
    notebook: Path
    launch: LaunchOptions = LaunchOptions()
    output: Path | None = None
    """The executed notebook (default: ``RUN_DIR/output.ipynb``), saved after every cell."""
    command: str = ""
    """How the run was started, for ``result.json``."""


@dataclass
class RunResult:
    status: str
    exit_code: int
    run_dir: Path
    output: Path
    message: str = ""
    record: RunRecord | None = None
    outcome: JobOutcome | None = None
    executed: Any = None
    """The executed notebook (nbformat), cell for cell the input plus any ``-p`` cell."""

    def raise_for_status(self) -> None:
        """Raise the run's :class:`nbddp.errors.RunError`, carrying its judged outcome, unless it succeeded."""
        if self.status == Status.SUCCEEDED:
            return
        if self.outcome is not None and self.outcome.status == self.status:
            raise run_error(self.outcome, self.run_dir)
        from nbddp.errors import RunFailed, RunInterrupted, RunTimeout  # a kernel cell failed, not a rank

        cls = {Status.TIMEOUT: RunTimeout, Status.INTERRUPTED: RunInterrupted}.get(Status(self.status), RunFailed)
        raise cls(self.message, exit_code=self.exit_code, run_dir=str(self.run_dir))


def run_notebook(options: RunOptions, sinks: Sequence[Sink] | None = None,
                 say: Callable[[str], None] | None = None, notebook: Notebook | None = None) -> RunResult:
    """Run the notebook; returns the result (never raises for a failed *run*, only for bad input).

    ``notebook``: already in memory (papermill's parameterized copy); ``options.notebook`` names it.
    """
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    launch = options.launch
    notebook = notebook or read_notebook(options.notebook)
    devices = devices_for(launch)
    script = generate(notebook, ExportOptions(engine=launch.engine, parameters=launch.parameters,
                                              returns=launch.returns))
    check_defined(script)
    parameters = effective_parameters(declared_parameters(notebook), launch.parameters)
    if devices.note:
        say(f"nbddp: {devices.note}")
    for line in topology_notes(launch):
        say(line)
    cwd = notebook.path.resolve().parent
    spec = job_spec(script, launch, devices, notebook.path, cwd, pool=_batch_pool(launch, script.engine, devices, cwd, say))
    if launch.nodes is not None and launch.nodes.rank != 0:
        return _run_other_node(options, spec, parameters, sinks, say)
    run_dir = spec.run_dir
    output = Path(options.output or RunDir(run_dir).output)
    deadline = deadline_of(launch)
    collector = NotebookOutputSink(run_dir)
    terminal = TerminalSink() if sinks is None else None
    all_sinks = [collector, *(sinks if terminal is None else [terminal])]
    executed, numbers = kernel_notebook(notebook, launch.parameters)
    say(f"nbddp: {script.engine} engine, {_where(spec)}; run dir {run_dir}")
    with Job.start(spec) as job:
        echo = terminal.line if terminal is not None else None  # kernel cells print above the epoch bar
        runner = _NotebookRun(job, executed, numbers, notebook, collector, all_sinks, deadline, cwd, echo,
                              launch.idle_timeout, output)
        try:
            status, code, message = runner.run()
        finally:
            if terminal is not None:
                terminal.close()
    result = RunResult(status, code, run_dir, output, message, outcome=runner.outcome, executed=executed)
    result.record = job.record(status, code, message, runner.outcome, parameters, str(notebook.path),
                               overrides=launch.parameters, command=options.command)
    _write_notebook(executed, output)
    say(_summary(result))
    return result


def _batch_pool(launch: LaunchOptions, engine: str, devices: Any, cwd: Path, say: Callable[[str], None]) -> Any:
    """The warm ranks ``nbddp batch`` keeps for this run's device slot (:data:`warm_pool.POOL_ENV`),
    if they can take it; ``None``: this run starts its own, as ``nbddp run`` alone always does."""
    from nbddp.launchers.warm_pool import POOL_ENV, WarmPool, pool_key, why_fresh

    folder = os.environ.get(POOL_ENV)
    if not folder or engine != "torch" or launch.nodes or launch.slurm or launch.max_restarts:
        return None

    try:
        pool = WarmPool.adopt(Path(folder), devices)
    except ValueError:
        why = "they are gone"
    else:
        why = why_fresh(pool, pool_key(devices, cwd, launch.collective_timeout), pool.idle)
    if why:
        say(f"nbddp: not on the batch's warm ranks ({why}): starting fresh ones")
        return None
    say(f"nbddp: on the batch's warm ranks (this slot's run {pool.runs + 1} on them)")
    return pool


def _run_other_node(options: RunOptions, spec: JobSpec, parameters: dict[str, Any], sinks: Sequence[Sink] | None,
                    say: Callable[[str], None]) -> RunResult:
    """Node 1 and up of a multi-node run: only this node's ranks (node 0 runs the kernel, gets the weights)."""
    launch = options.launch
    say(f"nbddp: node {launch.nodes.rank} of {launch.nodes.count}: {spec.script.engine} engine, {_where(spec)}; "
        f"run dir {spec.run_dir}")
    terminal = TerminalSink() if sinks is None else None
    status, code, message, outcome = Status.FAILED, 1, "", None
    with Job.start(spec) as job:
        try:
            outcome = job.wait(sinks if terminal is None else [terminal], deadline_of(launch), launch.idle_timeout)
            status, code, message = outcome.status, outcome.exit_code, outcome.message
        except KeyboardInterrupt:
            status, code, message = Status.INTERRUPTED, 130, "interrupted (SIGINT); this node's ranks were stopped."
        except SignalReceived as exc:
            status, code = Status.INTERRUPTED, 128 + exc.signum
            message = f"interrupted ({signal.Signals(exc.signum).name}); this node's ranks were stopped."
        finally:
            if terminal is not None:
                terminal.close()
    result = RunResult(status, code, spec.run_dir, RunDir(spec.run_dir).output, message, outcome=outcome)
    result.record = job.record(status, code, message, outcome, parameters, str(options.notebook),
                               overrides=launch.parameters, command=options.command)
    ending = Ending(status, result.record.wall_time_s, spec.run_dir, "node 0 holds the weights")
    line = f"nbddp: node {launch.nodes.rank}: {ending.line()}"
    say(f"nbddp: error: {message}\n{line}" if message else line)
    return result


def topology_notes(launch: LaunchOptions) -> list[str]:
    """What a user must know before a multi-node run starts (said once, on every node)."""
    if launch.nodes is None and (launch.slurm is None or launch.slurm.nodes == 1):
        return []
    where = f"port {launch.nodes.host_port()[1]} of node 0" if launch.nodes else "a port of the job's first node"
    return [f"nbddp: note: the rendezvous store listens on {where} on every network interface (torch's TCPStore): "
            "anyone who can reach it can join or disrupt the run. Run multi-node jobs on a trusted network."]


def _where(spec: JobSpec) -> str:
    if spec.slurm is not None:
        return f"a Slurm job of {spec.slurm.nodes} node{'s' * (spec.slurm.nodes != 1)} × {spec.devices.describe()}"
    if spec.nodes is not None:
        return f"{spec.devices.describe()} on each of {spec.nodes.count} nodes (world size {spec.world_size})"
    return spec.devices.describe()


class _NotebookRun:
    """Executes the kernel's side of one run, beside the job."""

    def __init__(self, job: Job, nb, numbers: list[int | None], notebook: Notebook,
                 collector: NotebookOutputSink, sinks: Sequence[Sink], deadline: float | None, cwd: Path,
                 echo: Callable[[str], Any] | None = None, idle_timeout: float | None = None,
                 output: Path | None = None) -> None:
        self.job, self.nb, self.numbers, self.notebook, self.echo = job, nb, numbers, notebook, echo
        self.idle_timeout, self.output = idle_timeout, output
        self.collector, self.sinks, self.deadline, self.cwd = collector, sinks, deadline, cwd
        self.outcome: JobOutcome | None = None
        self._cleanup: list[Callable[[], Any]] = []

    def run(self) -> tuple[str, int, str]:
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError, CellTimeoutError

        from jupyter_client import KernelManager

        kernel_name = self.notebook.kernel_name or "python3"
        # IPC sockets: local only, no "running over TCP without encryption" warning. Their files
        # default to the working directory, where two runs would collide: use a private temp dir.
        sockets = kernel_socket_dir()
        self._cleanup.append(lambda: shutil.rmtree(sockets, ignore_errors=True))
        manager = KernelManager(kernel_name=kernel_name, transport="ipc", ip=os.path.join(sockets, "k"))
        client = NotebookClient(self.nb, km=manager, kernel_name=kernel_name, shutdown_kernel="immediate",
                                resources={"metadata": {"path": str(self.cwd)}}, timeout=None)
        pump = _Pump(self.job, self.sinks)
        pump.start()  # stream ranks while the kernel starts and runs the setup cells
        trained = False
        try:
            # We made the manager, so we shut the kernel down. Its start-up overlaps the ranks'; at a
            # lower CPU priority it never slows them where cores are scarce (it has slack until training ends).
            with client.setup_kernel(cleanup_kc=True, preexec_fn=_lower_priority):
                for index, cell in enumerate(self.nb.cells):
                    if cell.cell_type != "code":
                        continue
                    if cell.metadata.get("nbddp_role") == TRAIN:
                        if trained:
                            cell.outputs = [_note("ran as part of the DDP job above")]
                            continue
                        pump.stop()
                        cell.outputs = [_note("training as a DDP job; every rank's log is in the run dir")]
                        self._save()
                        status = self._train(client, cell, index)
                        if status is not None:
                            return status
                        trained = True
                        continue
                    client.timeout = self._remaining()
                    client.execute_cell(cell, index)
                    self._echo(index, cell)
                    self._save()
            return Status.SUCCEEDED, 0, ""
        except (CellExecutionError, CellTimeoutError) as exc:
            if isinstance(exc, CellTimeoutError):
                return self._stopped(Status.TIMEOUT, 124, "the run exceeded --timeout.")
            number = self.numbers[index]
            return Status.FAILED, 1, f"{self.notebook.path}: cell {number} raised in the kernel:\n{_short(exc)}"
        except KeyboardInterrupt:
            return self._stopped(Status.INTERRUPTED, 130, "interrupted (SIGINT); every rank and the kernel were stopped.")
        except SignalReceived as exc:
            name = signal.Signals(exc.signum).name
            return self._stopped(Status.INTERRUPTED, 128 + exc.signum, f"interrupted ({name}); every rank and the kernel were stopped.")
        finally:
            pump.stop()
            for cleanup in self._cleanup:
                cleanup()

    def _train(self, client, cell, index: int) -> tuple[str, int, str] | None:
        """Wait for the job in place of the training cell; ``None`` when it succeeded and loaded."""
        outcome = self.job.wait(self.sinks, self.deadline, self.idle_timeout)
        self.outcome = outcome
        cell.outputs = self.collector.outputs()
        if outcome.status != Status.SUCCEEDED:
            cell.outputs.append(_error_output(outcome))
            return outcome.status, outcome.exit_code, outcome.message
        loader = _load_cell(self.job.checkpoint)
        client.timeout = self._remaining()
        client.execute_cell(loader, index)
        self.nb.cells[index] = cell  # nbclient puts the cell it ran at `index`: keep the user's
        cell.outputs.extend(loader.outputs)
        self._echo(index, loader)
        return None

    def _save(self) -> None:
        """The executed notebook so far, as papermill saves it: any stop keeps the cells that ran."""
        if self.output is not None:
            _write_notebook(self.nb, self.output)

    def _echo(self, index: int, cell) -> None:
        """Show a kernel cell's text output in the terminal too (e.g. the evaluation's accuracy)."""
        if self.echo is None:
            return
        number = self.numbers[index]
        label = f"[cell {number}] " if number else "[parameters] "
        for output in cell.outputs:
            text = output.get("text") if output.output_type == "stream" else output.get("data", {}).get("text/plain")
            if text:
                self.echo("".join(label + line + "\n" for line in str(text).rstrip("\n").split("\n")))

    def _stopped(self, status: str, code: int, message: str) -> tuple[str, int, str]:
        self.job.stop()
        if self.outcome is None:
            self.outcome = self.job.outcome(timed_out=status == Status.TIMEOUT, interrupted_by=code - 128 if status == Status.INTERRUPTED else None)
        return status, code, message

    def _remaining(self) -> int | None:
        """Seconds left for a kernel cell (nbclient takes whole seconds)."""
        return None if self.deadline is None else max(1, math.ceil(self.deadline - time.monotonic()))


SOCKETS_PREFIX = "nbddp-kernel-"


def kernel_socket_dir() -> str:
    """A private temp folder for the kernel's sockets (a run removes its own; the next removes a killed one's)."""
    return owned_temp_dir(SOCKETS_PREFIX)


def _lower_priority() -> None:
    os.nice(5)


class _Pump(threading.Thread):
    """Streams the job's output from a background thread while the main thread runs kernel cells."""

    def __init__(self, job: Job, sinks: Sequence[Sink]) -> None:
        super().__init__(daemon=True, name="nbddp-pump")
        self.job, self.sinks = job, sinks
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.05):
            self.job.pump(self.sinks)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()


def kernel_notebook(notebook: Notebook, parameters: dict[str, Any]):
    """A copy of the notebook for the kernel: roles marked, parameters injected the papermill way.

    The injected cell is written with the same literal writer as the script, so
    the kernel and the ranks see exactly the same values. Returns the notebook
    and, per cell, its number in the user's notebook (``None`` for the injected cell).
    """
    import copy

    from nbformat.v4 import new_code_cell

    nb = copy.deepcopy(notebook.nb)
    numbers: list[int | None] = []
    insert_at = 0
    for number, cell in enumerate(nb.cells, start=1):
        numbers.append(number)
        role = cell_role(notebook.cells[number - 1], notebook.path)
        if role is not None:
            cell.metadata["nbddp_role"] = role
        if role in (PARAMETERS, INJECTED):
            insert_at = number
    if parameters:
        injected = new_code_cell("# Parameters (nbddp -p)\n" + "\n".join(assignments(parameters)),
                                 metadata={"tags": ["injected-parameters"]})
        nb.cells.insert(insert_at, injected)
        numbers.insert(insert_at, None)
    return nb, numbers


def _load_cell(checkpoint: Path):
    from nbformat.v4 import new_code_cell

    return new_code_cell(
        "from nbddp.checkpoint import load_returns as _nbddp_load, load_into as _nbddp_into\n"
        f"_nbddp_states, _nbddp_note = _nbddp_load({str(checkpoint)!r})\n"
        "print('[nbddp] loaded the trained', ', '.join(_nbddp_into(globals(), _nbddp_states)),"
        f" 'on the CPU from {checkpoint.name}' + (f' ({{_nbddp_note}})' if _nbddp_note else ''))\n"
        "del _nbddp_load, _nbddp_into, _nbddp_states, _nbddp_note"
    )


def _note(text: str) -> dict:
    from nbformat.v4 import new_output

    return new_output("stream", name="stdout", text=f"[nbddp] {text}\n")


def _error_output(outcome: JobOutcome) -> dict:
    from nbformat.v4 import new_output

    first = outcome.errors[0] if outcome.errors else None
    return new_output("error", ename=first.type if first else "RunFailed",
                      evalue=outcome.message.splitlines()[0] if outcome.message else outcome.status,
                      traceback=outcome.message.splitlines())


def _short(exc: Exception) -> str:
    ename, evalue = getattr(exc, "ename", type(exc).__name__), getattr(exc, "evalue", str(exc))
    return f"{ename}: {evalue}"


def _write_notebook(nb, path: Path) -> None:
    """Write atomically (a kill mid-write leaves the previous save), without nbddp's own cell marks."""
    import copy

    import nbformat

    nb = copy.copy(nb)
    nb.cells = [copy.copy(cell) for cell in nb.cells]
    for cell in nb.cells:
        cell.metadata = nbformat.from_dict({k: v for k, v in cell.metadata.items() if k != "nbddp_role"})
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    nbformat.write(nb, partial)
    os.replace(partial, path)


def _summary(result: RunResult) -> str:
    """The run's ending: its error (if any), then one line, then the final metrics."""
    record = result.record
    weights = RunDir(result.run_dir).weights
    ending = Ending(result.status, record.wall_time_s, result.run_dir,
                    f"weights {shown_path(weights)}" if weights.exists() else NO_WEIGHTS, metrics=record.final_metrics)
    lines = [f"nbddp: error: {result.message}"] if result.message else []
    lines.append(f"nbddp: {ending.line()} · notebook {shown_path(result.output)}")
    if ending.metrics_line():
        lines.append(f"nbddp: {ending.metrics_line()}")
    return "\n".join(lines)
