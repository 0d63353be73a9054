"""A notebook's own cells in a Jupyter kernel beside the DDP job: the kernel of ``nbddp run`` and of
``papermill --engine nbddp``.

The kernel runs every cell but the training cells, in order, while the ranks train: the cells
before the training (parameters, imports, data) while the ranks start, streaming their output
meanwhile; at the training cell it waits for the job (the orchestrator's ``train()``), then
*receives* it: the cell's outputs are every rank's lines, and the kernel runs, at that cell's
place, either a cell that loads the trained weights on the CPU or one that raises the run's
judged error (:class:`~nbddp.contracts.errors.RunFailed`, :class:`~nbddp.contracts.errors.RunTimeout`, …). So a failed
run fails the notebook exactly where a failing cell would, with the kernel's own error and
execution count, and nbclient's (or papermill's) own bookkeeping applies. The cells after it
evaluate the trained model.

:class:`TrainingCells` is the mixin that teaches an nbclient ``NotebookClient`` (or papermill's
subclass of it) to do that; :class:`NotebookKernel` drives it for ``nbddp run``, and the papermill
door subclasses it to let papermill drive its own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import os
import re
import shlex
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from nbddp.contracts.atomic import write_json
from nbddp.display.terminal import NotebookOutputSink
from nbddp.contracts.errors import NotebookError, RunError
from nbddp.contracts.rank_env import beside_a_job
from nbddp.job import trackers
from nbddp.job.follow import Sink
from nbddp.job.lifecycle import Job
from nbddp.job.orchestrator import Kernel, KernelResult, Train
from nbddp.job.outcome import JobOutcome, run_error
from nbddp.contracts.status import Status
from nbddp.contracts.process_groups import owned_temp_dir
from nbddp.notebook.cells import INJECTED, PARAMETERS
from nbddp.notebook.literals import assignments
from nbddp.notebook.reader import Notebook

if TYPE_CHECKING:
    from jupyter_client import AsyncKernelManager
    from nbclient import NotebookClient
    from nbformat import NotebookNode

SOCKETS_PREFIX = "nbddp-kernel-"
PUMP_SECONDS = 0.05


def kernel_for(notebook: Notebook) -> str:
    """The kernel ``nbddp run`` runs ``notebook`` in: the one its metadata names (``python3`` where none; as Jupyter
    does, whatever its case), but this Python's plain kernel for the nbddp kernel. That one only starts the warm ranks'
    starter sooner, which beside a job it doesn't (:mod:`nbddp.doors.jupyter.kernel_start`), and its kernelspec names
    the Python that installed it, which may be another environment's than this run's. ``python3`` is asked nothing:
    ipykernel, a requirement, is always that kernel (Jupyter's search of its kernelspecs takes 0.3 s here).

    Raises:
        NotebookError: no kernel of that name is installed here (asked before anything starts).
    """
    from nbddp.doors.jupyter.kernelspec import KERNEL_NAME

    name = (notebook.kernel_name or "python3").lower()
    if name in ("python3", KERNEL_NAME):
        return "python3"
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    manager = KernelSpecManager()
    try:
        manager.get_kernel_spec(name)
    except NoSuchKernel:
        raise NotebookError(
            f"{notebook.path}: its kernel {name!r} is not installed here (installed: "
            f"{', '.join(sorted(manager.find_kernel_specs())) or 'none'}). Install it (`python -m ipykernel install "
            f"--user --name {shlex.quote(name)}` in the environment it should run), or choose one of these in "
            "Jupyter (Kernel > Change Kernel) and save the notebook.") from None
    return name


def kernel_notebook(notebook: Notebook, parameters: dict[str, Any]) -> tuple[NotebookNode, list[int | None]]:
    """A copy of the notebook for the kernel, ``-p`` parameters injected the papermill way.

    The injected cell is written with the same literal writer as the script, so the kernel and the
    ranks see exactly the same values. Returns the notebook and, per cell, its number in the user's
    notebook (``None`` for the injected cell).
    """
    from nbformat.v4 import new_code_cell

    nb = copy.deepcopy(notebook.nb)
    numbers: list[int | None] = []
    insert_at = 0
    for number, cell in enumerate(nb.cells, start=1):
        numbers.append(number)
        if notebook.cells[number - 1].role in (PARAMETERS, INJECTED):
            insert_at = number
    if parameters:
        injected = new_code_cell("# Parameters (nbddp -p)\n" + "\n".join(assignments(parameters)),
                                 metadata={"tags": [INJECTED]})
        nb.cells.insert(insert_at, injected)
        numbers.insert(insert_at, None)
    return nb, numbers


class TrainingCells:
    """Mixin for nbclient's ``NotebookClient``: a training cell (marked, or chosen where no cell is: the
    script's :attr:`~nbddp.notebook.script.Script.training`) is received from the DDP job, not run.

    ``nbddp_kernel`` (set before executing) does the receiving; every other cell runs as usual.
    """

    nbddp_kernel: "NotebookKernel"

    def execute_cell(self, cell: NotebookNode, cell_index: int, execution_count: int | None = None,
                     store_history: bool = True) -> NotebookNode:
        if self.nbddp_kernel.trains(cell_index):
            return self.nbddp_kernel.receive(self, cell, cell_index)
        with _interrupt_settles_the_cell(self):
            return super().execute_cell(cell, cell_index, execution_count, store_history)

    def run_in_kernel(self, cell: NotebookNode, cell_index: int, store_history: bool = True) -> NotebookNode:
        """Run ``cell`` in the kernel at ``cell_index`` the ordinary way (nbclient's own execute_cell);
        ``store_history=False``: unseen (no execution count, nothing in the kernel's history)."""
        with _interrupt_settles_the_cell(self):
            return super().execute_cell(cell, cell_index, store_history=store_history)

    def on_rank_lines(self, text: str) -> None:
        """Rank output added to the training cell while it trains (papermill's client logs it, saves)."""


#: How long a kernel interrupted with its notebook gets to answer the running cell (its ``KeyboardInterrupt``).
ANSWER_SECONDS = 5.0


@contextlib.contextmanager
def _interrupt_settles_the_cell(client: NotebookClient) -> Iterator[None]:
    """A Ctrl-C while the kernel runs a cell ends that cell as a front end's stop button would, and leaves
    nothing running on nbclient's event loop.

    nbclient runs a cell as a task on this thread's event loop (``run_sync``). A ``KeyboardInterrupt``
    raised while that loop waits for the kernel's reply leaves the loop, but not the task: it stays
    pending, with its poll of whether the kernel is alive, and wakes up the next time the loop runs,
    which is when nbclient shuts the kernel down on the way out. What it then finds was a race: the
    kernel's answer (its ``KeyboardInterrupt``, recorded in the cell, as papermill's own engine shows it)
    or, when the shutdown lasted past the task's once-a-second check, a kernel gone (``DeadKernelError``,
    "Kernel died while waiting for execute reply", logged as "Task exception was never retrieved" after
    papermill's ``Aborted!``: 1 papermill Ctrl-C in 3 with the ranks loading a 2-core machine). So the
    kernel is interrupted here and given :data:`ANSWER_SECONDS` to answer the cell, whose task records
    the answer; what is left is then cancelled, as ``asyncio.run`` cancels what its interrupted main
    coroutine left, and the interrupt goes on."""
    try:
        yield
    except KeyboardInterrupt:
        from jupyter_core.utils import ensure_async, ensure_event_loop

        loop = ensure_event_loop()
        left = [task for task in asyncio.all_tasks(loop) if not task.done()]
        if not left or loop.is_running():
            raise
        try:
            loop.run_until_complete(asyncio.wait_for(ensure_async(client.km.interrupt_kernel()), ANSWER_SECONDS))
            loop.run_until_complete(asyncio.wait(left, timeout=ANSWER_SECONDS))
        except (Exception, KeyboardInterrupt):  # noqa: BLE001 - a kernel that can't answer (or a second Ctrl-C)
            pass
        finally:
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        raise


class NotebookKernel(Kernel):
    """The notebook's cells in a kernel beside the job (:class:`nbddp.job.orchestrator.Kernel`)."""

    def __init__(self, nb: NotebookNode, numbers: Sequence[int | None], notebook: Notebook, cwd: Path,
                 collector: NotebookOutputSink, sinks: Sequence[Sink], training: Sequence[int],
                 save: Callable[[Any], None] | None = None, echo: Callable[[str], Any] | None = None,
                 kernel_name: str = "python3") -> None:
        """``nb``/``numbers``: from :func:`kernel_notebook`; ``collector``: the training cell's output
        (also one of ``sinks``); ``training``: the numbers of the cells the job trains (the script's);
        ``save(nb)``: write the notebook so far; ``echo``: show a kernel cell's text output (the terminal);
        ``kernel_name``: the kernel to start (:func:`kernel_for`)."""
        self.nb, self.numbers, self.notebook, self.cwd = nb, list(numbers), notebook, cwd
        self.kernel_name = kernel_name
        self.training = frozenset(training)
        self.collector, self.sinks = collector, list(sinks)
        self.save, self.echo = save, echo
        self.job: Job | None = None
        self.train: Train | None = None
        self.outcome: JobOutcome | None = None
        self.loaded: list[str] = []
        self._pump: _Pump | None = None
        self.collector.on_lines = self._on_lines
        self._client: Any = None
        self._cleanup: list[Callable[[], Any]] = []

    # ------------------------------------------------------------ the orchestrator's Kernel

    def shares_records_later(self) -> bool:
        """The kernel's cells before the training name a tracker: they may open a record (``mlflow.start_run()``),
        which rank 0 then writes into; it waits for the kernel's word at its first record."""
        first = min((index for index in range(len(self.nb.cells)) if self.trains(index)), default=len(self.nb.cells))
        return trackers.kernel_may_open_records(
            [str(cell.source) for cell in self.nb.cells[:first] if cell.cell_type == "code"])

    def run(self, job: Job, train: Train, deadline: float | None) -> KernelResult:
        self.job, self.train = job, train
        self._pump = _Pump(job, self.sinks)
        self._pump.start()  # stream the ranks while the kernel starts and runs the setup cells
        try:
            return self.execute(deadline)
        finally:
            self._pump.stop()
            for cleanup in self._cleanup:
                cleanup()

    def execute(self, deadline: float | None) -> KernelResult:
        """Run every cell, each given what is left of ``--timeout``; the ``nbddp run`` loop."""
        from nbclient.exceptions import CellExecutionError, CellTimeoutError

        client = self._client = self.client()
        index = 0
        try:
            with client.setup_kernel(cleanup_kc=True, preexec_fn=_lower_priority, env=kernel_environment()):
                for index, cell in enumerate(self.nb.cells):
                    if cell.cell_type != "code":
                        continue
                    client.timeout = _seconds_left(deadline)
                    client.execute_cell(cell, index)
                    if not self.trains(index):
                        self._echo(index, self.nb.cells[index].outputs)
                    self._save()
        except CellTimeoutError:
            return KernelResult.failed("the run exceeded --timeout.", Status.TIMEOUT)
        except CellExecutionError as exc:
            return self.failed_cell(index, getattr(exc, "ename", type(exc).__name__), getattr(exc, "evalue", str(exc)),
                                    getattr(exc, "traceback", ""))
        return KernelResult(loaded=list(self.loaded))

    def client(self) -> NotebookClient:
        """``nbddp run``'s client: a kernel with private IPC sockets, at a lower CPU priority."""
        from nbclient import NotebookClient

        class Client(TrainingCells, NotebookClient):
            pass

        client = Client(self.nb, km=self.kernel_manager(self.kernel_name), kernel_name=self.kernel_name,
                        shutdown_kernel="immediate", resources={"metadata": {"path": str(self.cwd)}}, timeout=None)
        client.nbddp_kernel = self
        return client

    def kernel_manager(self, kernel_name: str) -> AsyncKernelManager:
        """A manager whose kernel talks over private IPC sockets: local only, and without ipykernel's
        "Kernel is running over TCP without encryption" warning on every run (jupyter_client's default
        is TCP). The socket files default to the working folder, where two runs would collide: they go
        in a private temp folder (a short path: a socket's has a length limit), removed when the run ends.
        Asynchronous, as the manager nbclient makes itself: with a blocking one, nbclient's wait for a cell's reply
        blocks its own event loop and a cell's time limit (papermill's ``--execution-timeout``) never fires."""
        from jupyter_client import AsyncKernelManager

        sockets = owned_temp_dir(SOCKETS_PREFIX, for_sockets=True)
        self._cleanup.append(lambda: shutil.rmtree(sockets, ignore_errors=True))
        return AsyncKernelManager(kernel_name=kernel_name, transport="ipc", ip=os.path.join(sockets, "k"))

    def failed_cell(self, index: int, ename: str, evalue: str, traceback: str = "") -> KernelResult:
        """A kernel cell (not the job) failed: the run failed there. ``traceback``: the kernel's, which
        names the line (``Cell In[N], line L``)."""
        if self.outcome is not None and self.outcome.status != Status.SUCCEEDED and self.trains(index):
            return KernelResult.failed(self.outcome.message, self.outcome.status)  # the job's own failure
        number = self.numbers[index]
        line = cell_line(traceback, self.nb.cells[index].get("execution_count"))
        where = (f"cell {number}" if number else "the injected parameters cell") + (f", line {line}" if line else "")
        return KernelResult.failed(f"{self.notebook.path}: {where} raised in the kernel:\n{ename}: {evalue}",
                                   exc_type=ename, exc_message=evalue, cell=number, line=line,
                                   run_dir=str(self.job.run_dir) if self.job is not None else None)

    # ------------------------------------------------------------ the training cell

    def trains(self, index: int) -> bool:
        """Whether the kernel's cell ``index`` is a training cell: received from the job, never run here."""
        return self.numbers[index] in self.training

    def receive(self, client: TrainingCells, cell: NotebookNode, index: int) -> NotebookNode:
        """In place of the training cell: wait for the job, then load its weights or raise its error."""
        if self.outcome is not None:  # a second training cell: one job trained them all
            cell.outputs = [_note("ran as part of the DDP job above")]
            return cell
        self._pump.stop()  # this thread follows the job now
        self._client = client
        if self.collector.output.text:  # what the ranks said while the kernel ran the cells before (papermill logs it)
            client.on_rank_lines(self.collector.output.text)
        cell.outputs = [_note("training as a DDP job; every rank's log is in the run dir"), self.collector.output]
        if self.shares_records_later():
            self._share_open_records(client, index)
        self.on_training_start(cell, index)
        self.outcome = self.train(*self.training_deadline())
        receipt = receipt_cell(self.job, self.outcome)
        try:
            client.run_in_kernel(receipt, index)
            if self.outcome.status == Status.SUCCEEDED:
                self.loaded = list(self.job.script.returns)
        finally:
            cell.outputs = [*self.collector.outputs(), *receipt.outputs]
            cell.execution_count = receipt.execution_count
            client.nb.cells[index] = cell  # nbclient put the receipt there: the user's cell stays
            self._echo(index, receipt.outputs)  # (the ranks' lines were shown as they came)
        return cell

    def _share_open_records(self, client: TrainingCells, index: int) -> None:
        """Tell rank 0 which records the kernel has open now, at the training cell (it waits for the word)."""
        from nbformat.v4 import new_code_cell

        path, cell = self.job.paths.kernel_records, client.nb.cells[index]
        try:
            client.run_in_kernel(new_code_cell(from_nbddp(
                "from nbddp.job.trackers import share_open_records as _nbddp_share",
                f"_nbddp_share({str(path)!r})", "del _nbddp_share")), index, store_history=False)
        except Exception:  # noqa: BLE001 - a kernel that can't say: rank 0's records are its own
            pass
        finally:
            client.nb.cells[index] = cell  # (nbclient put the unseen cell there)
            if not path.exists():
                write_json(path, {"variables": {}, "names": []})

    def training_deadline(self) -> tuple[float | None, str | None]:
        """A deadline of the training cell's own and its name (papermill's ``--execution-timeout``);
        ``(None, None)``: the run's."""
        return None, None

    def on_training_start(self, cell: NotebookNode, index: int) -> None:
        self._save()

    def _on_lines(self, text: str) -> None:
        if self._client is not None:
            self._client.on_rank_lines(text)

    # ------------------------------------------------------------ nbddp run's terminal and file

    def _save(self) -> None:
        if self.save is not None:
            self.save(self.nb)

    def _echo(self, index: int, outputs: Sequence[Any]) -> None:
        """Show a kernel cell's text output in the terminal too (e.g. the evaluation's accuracy)."""
        if self.echo is None:
            return
        number = self.numbers[index]
        label = f"[cell {number}] " if number else "[parameters] "
        for output in outputs:
            text = output.get("text") if output.output_type == "stream" else output.get("data", {}).get("text/plain")
            if text:
                self.echo("".join(label + line + "\n" for line in str(text).rstrip("\n").split("\n")))


def receipt_cell(job: Job, outcome: JobOutcome) -> NotebookNode:
    """What the kernel runs in the training cell's place: load the weights, or raise the run's error."""
    from nbformat.v4 import new_code_cell

    if outcome.status == Status.SUCCEEDED and not job.script.returns:
        return new_code_cell(f"print({('[nbddp] ' + job.script.returns_note)!r})")
    if outcome.status == Status.SUCCEEDED:
        checkpoint = job.checkpoint
        return new_code_cell(from_nbddp(
            "from nbddp.contracts.checkpoint import load_returns as _nbddp_load, load_into as _nbddp_into",
            f"_nbddp_states, _nbddp_note = _nbddp_load({str(checkpoint)!r})\n"
            "print('[nbddp] loaded the trained', ', '.join(_nbddp_into(globals(), _nbddp_states)),"
            f" {'on the CPU from ' + checkpoint.name!r} + (f' ({{_nbddp_note}})' if _nbddp_note else ''))",
            "del _nbddp_load, _nbddp_into, _nbddp_states, _nbddp_note"))
    return new_code_cell(raise_code(run_error(outcome, job.paths)))


def from_nbddp(imports: str, code: str, cleanup: str) -> str:
    """Kernel code that runs ``code`` with ``imports`` (of nbddp's modules) made from where nbddp is installed.

    The kernel's module path starts with the notebook's folder (IPython puts it there for the user's own modules),
    where another user may have written an ``nbddp.py``: nbddp's own imports in the kernel look past it, the user's
    own imports find the folder as before (the path is put back at once). ``cleanup`` runs last (its names)."""
    return ("import sys as _nbddp_sys, os as _nbddp_os\n"
            "_nbddp_path = _nbddp_sys.path[:]\n"
            "_nbddp_sys.path[:] = [p for p in _nbddp_path if p not in ('', '.', _nbddp_os.getcwd())]\n"
            f"try:\n    {imports}\nfinally:\n    _nbddp_sys.path[:] = _nbddp_path\n"
            "del _nbddp_sys, _nbddp_os, _nbddp_path\n"
            f"{code}\n{cleanup}")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def cell_line(traceback: str, execution_count: int | None) -> int | None:
    """The line of the cell that ran as ``In[execution_count]`` where its error was raised, from the kernel's
    traceback (IPython's ``Cell In[N], line L``; the innermost frame in that cell); ``None`` if it names none."""
    if execution_count is None:
        return None
    lines = re.findall(rf"Cell In\[{int(execution_count)}\], line (\d+)", _ANSI.sub("", traceback))
    return int(lines[-1]) if lines else None


def raise_code(error: RunError) -> str:
    """Code that raises ``error`` again in a kernel (its class, message and fields: all plain values)."""
    fields = ", ".join(f"{name}={getattr(error, name)!r}" for name in error.FIELDS)
    name = type(error).__name__
    return from_nbddp(f"from nbddp.contracts.errors import {name}", f"raise {name}({str(error)!r}, {fields})", "")


class _Pump(threading.Thread):
    """Streams the job's output from a background thread while the main thread runs kernel cells."""

    def __init__(self, job: Job, sinks: Sequence[Sink]) -> None:
        super().__init__(daemon=True, name="nbddp-pump")
        self.job, self.sinks = job, sinks
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(PUMP_SECONDS):
            self.job.pump(self.sinks)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()


def _seconds_left(deadline: float | None) -> int | None:
    """Seconds left for a kernel cell (nbclient takes whole seconds)."""
    return None if deadline is None else max(1, math.ceil(deadline - time.monotonic()))


def kernel_environment() -> dict[str, str]:
    """The kernel's environment: this process's, marked as a kernel beside a job (its ``%load_ext nbddp`` prepares
    no warm ranks: the job's ranks are its own)."""
    return beside_a_job(os.environ)


def _lower_priority() -> None:
    """The kernel's start-up overlaps the ranks'; at a lower CPU priority it never slows them where
    cores are scarce (it has slack until training ends)."""
    os.nice(5)


def _note(text: str) -> NotebookNode:
    from nbformat.v4 import new_output

    return new_output("stream", name="stdout", text=f"[nbddp] {text}\n")
