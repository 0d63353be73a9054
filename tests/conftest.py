"""Shared fixtures: notebooks written with nbformat, and process-leak checks."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterable
from typing import Callable, TypeVar

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

# Tests send SIGINT to mean Ctrl-C. A shell without job control starts background commands
# (`.ci/run &`, nohup) with SIGINT ignored, and every process the suite starts would inherit that
# and never see it: give the suite, and through it its children, the default disposition back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: ``--cost N``: the costliest tests by CPU-seconds (tests/cost.py).
pytest_plugins = ["tests.cost"]

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "notebooks"
FIXTURES = Path(__file__).resolve().parent / "notebooks"


def code(source: str, *tags: str):
    return new_code_cell(source, metadata={"tags": list(tags)} if tags else {})


def md(source: str):
    return new_markdown_cell(source)


#: The notebook metadata of every notebook a test writes: the kernel it runs in.
PYTHON3 = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}


def docs_image(name: str) -> Path | None:
    """Where a test writes the documentation's picture ``name`` (``docs/img/NAME``), when asked to:
    ``NBDDP_SCREENSHOTS=docs/img python -m pytest -m slow tests/test_browser.py tests/test_batches.py`` refreshes
    them (docs/contributing.md); otherwise ``None`` and nothing is written."""
    folder = os.environ.get("NBDDP_SCREENSHOTS")
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder) / name


def write_notebook(path: Path, cells: Iterable) -> Path:
    """Write a valid v4 notebook (validated, as every notebook a test writes must be)."""
    nb = new_notebook(cells=list(cells), metadata=PYTHON3)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return path


@pytest.fixture
def notebook(tmp_path):
    """``notebook(cells, name=...)`` → path of a notebook written in ``tmp_path``."""

    def make(cells, name: str = "nb.ipynb") -> Path:
        return write_notebook(tmp_path / name, cells)

    return make


def cpu_rank(nproc: int | None = None) -> dict[str, str]:
    """The variables that make a process one of ``--cpu``'s ranks (``NBDDP_DEVICE=cpu``, and ``NBDDP_NPROC``
    for an engine that spawns its own): it runs on the CPU, with gloo, on a machine with GPUs too."""
    from nbddp.contracts.rank_env import RankEnv

    return RankEnv(device="cpu", nproc=nproc).variables()


@pytest.fixture
def as_cpu_rank(monkeypatch):
    """This process as one of ``--cpu``'s ranks: ``nbddp.prepare`` keeps models on the CPU, on a machine with
    GPUs too."""
    for name, value in cpu_rank().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def group(tmp_path, as_cpu_rank):
    """A real one-rank gloo process group in this process, a CPU rank (:func:`as_cpu_rank`). Torch is
    imported only by the tests that use it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def descendants(pid: int) -> set[int]:
    """PIDs of every live descendant of ``pid``, read from /proc (by PID, not by name): each process's
    ``task/*/children`` (the subtree alone: a CliRun asks ten times a second, and reading every process's
    ``stat`` took 4 ms of CPU a call on a busy machine)."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for thread in threads:
            try:
                with open(f"/proc/{parent}/task/{thread}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except OSError:
                continue
            for child in children:
                if child not in found and alive(child):
                    found.add(child)
                    todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, what: str, every: float = 0.1,
               detail: Callable[[], object] | None = None) -> T:
    """Poll ``condition()`` every ``every`` seconds until it returns something truthy, and return that; after
    ``timeout`` seconds fail with ``AssertionError("WHAT: not within TIMEOUT s")`` (with the last value seen, and
    ``detail()``: a log, the processes still alive).

    Every poll in the tests goes through here (tests/test_test_helpers.py keeps it so). A hand-written
    ``while ... and time.monotonic() < deadline`` that just ends at its deadline lets the test go on as if the
    thing had happened, and the asserts after it then pass, or fail far from the cause, though it never did.
    A ``condition`` that can tell it never will (the process it waits on has exited) raises at once."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            message = f"{what}: not within {timeout:g} s"
            if value is not None and value is not False:
                message += f" (last seen: {value!r})"
            if detail is not None:
                message += f"\n{detail()}"
            raise AssertionError(message)
        time.sleep(every)


def settled(condition: Callable[[], object], grace: float, every: float = 0.05) -> bool:
    """Whether ``condition()`` came true within ``grace`` seconds, for a helper whose caller asserts on what is left
    after the grace (the processes still alive): there, not settling is the answer, not the failure."""
    try:
        wait_until(condition, grace, "settled", every)
    except AssertionError:
        return False
    return True


def group_members(pgid: int) -> set[int]:
    """Live processes in process group ``pgid``."""
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.add(int(entry))
    return members


def survivors(pgid: int, grace: float = 3.0) -> set[int]:
    """Members of ``pgid`` still alive after ``grace`` seconds (helpers like
    multiprocessing's resource tracker exit a moment after their parent)."""
    settled(lambda: not group_members(pgid), grace)
    return group_members(pgid)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


PYTHON = sys.executable


class CliRun:
    """``nbddp ...`` as a real subprocess, with every descendant PID it ever had recorded.

    The kernel and the ranks run in sessions of their own, so they are found
    by walking /proc's parent links while the run is alive, not by group.
    """

    def __init__(self, args, cwd, env=None, prefix=()):
        """``prefix``: a command that runs ``nbddp`` (``prlimit --nofile=64 --``, ``unshare -m …``)."""
        import subprocess
        import threading

        self.lines: list[str] = []
        self.seen: set[int] = set()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        from nbddp.contracts.interpreter import module_argv

        self.proc = subprocess.Popen(  # (as the `nbddp` command starts: no module from the working folder)
            [*map(str, prefix), *module_argv("nbddp", *map(str, args))], cwd=cwd, env=full_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._reader.start()
        self._watcher.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def _watch(self):
        import time

        while self.proc.poll() is None:
            self.seen |= descendants(self.proc.pid)
            time.sleep(0.1)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        def seen() -> bool:
            if text in self.output:
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"never saw {text!r}: the run exited ({self.proc.returncode}); "
                                     f"output:\n{self.output}")
            return False

        wait_until(seen, timeout, f"{text!r} in the run's output", every=0.05, detail=lambda: f"output:\n{self.output}")

    def wait(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout)
        finally:
            kill_group(self.proc.pid)
        self._reader.join(5)
        return code

    def leftovers(self, grace: float = 3.0) -> set[int]:
        """Descendants seen during the run that are still alive ``grace`` seconds after it ended."""
        settled(lambda: not any(alive(p) for p in self.seen), grace)
        left = {p for p in self.seen if alive(p)}
        for pid in left:  # don't let one failed test poison the next
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return left


@pytest.fixture
def cli_run():
    runs = []

    def start(args, cwd, env=None, prefix=()) -> CliRun:
        run = CliRun(args, cwd, env, prefix)
        runs.append(run)
        return run

    yield start
    for run in runs:
        kill_group(run.proc.pid)
        run.leftovers(grace=0)


_cuda_missing: list[str] = []


def _why_no_gpu() -> str:
    """Why this machine can't run the ``gpu`` tests (``""``: it can), found once, on the first gpu test."""
    if not _cuda_missing:
        import torch

        from nbddp.contracts.devices import visible_gpu_count

        _cuda_missing.append(
            "" if torch.cuda.is_available() and visible_gpu_count() else
            "needs a GPU: torch.cuda.is_available() is False here" if not torch.cuda.is_available() else
            "needs a GPU that nbddp sees: NVML counts none (CUDA_VISIBLE_DEVICES?)")
    return _cuda_missing[0]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.gpu`` tests skip where there is no usable GPU (torch imported for the first of them
    only), or fail with ``NBDDP_REQUIRE_GPU=1``: on a GPU machine a skip would hide a broken setup."""
    if item.get_closest_marker("gpu") is not None and (reason := _why_no_gpu()):
        if os.environ.get("NBDDP_REQUIRE_GPU") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def ranks_prepared_ahead_where_tested(request, monkeypatch):
    """``%load_ext nbddp`` starts the warm ranks' starter ahead (2.5 CPU-seconds of imports) only in the modules that
    test warm ranks (``PREPARES_AHEAD = True``: the user's path, there); elsewhere the suite's many kernels that never
    train on warm ranks would pay it for nothing (``NBDDP_PREPARE_AHEAD=0``, which kernels inherit)."""
    if not getattr(request.module, "PREPARES_AHEAD", False):
        monkeypatch.setenv("NBDDP_PREPARE_AHEAD", "0")
    else:
        monkeypatch.delenv("NBDDP_PREPARE_AHEAD", raising=False)


@pytest.fixture(autouse=True)
def private_state_dir(tmp_path_factory, monkeypatch):
    """Live-run registry per test (children inherit it through the environment)."""
    monkeypatch.setenv("NBDDP_STATE_DIR", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(scope="session", autouse=True)
def no_temp_folders_left(tmp_path_factory):
    """The suite, like every run, leaves nothing in the system temp folder (kernel sockets, warm pools,
    torchelastic). The session's processes get a temp folder of their own (``TMPDIR``), so that what another
    nbddp user, or another test session, has in the machine's temp folder is neither counted nor disturbed."""
    import shutil
    import tempfile

    tmp_path_factory.getbasetemp()  # (pytest's own folders stay where they are: a socket's path has a length limit)
    own = Path(tempfile.mkdtemp(prefix="nbddp-tests-"))
    before = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = str(own)

    def leftovers() -> set[Path]:
        return {*own.glob("nbddp-kernel-*"), *own.glob("nbddp-warm-*"), *own.glob("torchelastic_*")}

    try:
        yield
        wait_until(lambda: not leftovers(), 10, "the tests' temp folders removed", every=0.2,  # a run's last
                   detail=lambda: f"left: {sorted(leftovers())}")  # cleanup may be a moment behind its exit
    finally:
        tempfile.tempdir = before[0]
        if before[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before[1]
        shutil.rmtree(own, ignore_errors=True)


class StoppedLastCell:
    """A notebook run in a real kernel (nbclient) on a thread of its own: every cell but the last, then the
    last one, which the test stops as the kernel's stop button does (:meth:`stop`). For runs on a cluster
    whose last cell must stay interruptible (pending in a queue, training on the cluster's workers)."""

    def __init__(self, nb, folder: Path, timeout: float = 300) -> None:
        import threading

        from nbclient import NotebookClient

        self.nb = nb
        self.client = NotebookClient(nb, timeout=timeout, resources={"metadata": {"path": str(folder)}})
        self.errors: list[Exception] = []
        self.before_last = threading.Event()
        self.thread = threading.Thread(target=self._execute, daemon=True)
        self.thread.start()

    def _execute(self) -> None:
        last = len(self.nb.cells) - 1
        with self.client.setup_kernel():
            for index in range(last):
                self.client.execute_cell(self.nb.cells[index], index)
            self.before_last.set()
            try:
                self.client.execute_cell(self.nb.cells[last], last)
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                self.errors.append(exc)

    @classmethod
    def after_training(cls, flags: str, last_cell: str, folder: Path) -> "StoppedLastCell":
        """``%%ddp_train FLAGS`` on :mod:`tests.linear_fit`'s training, the kernel's evaluation, then
        ``last_cell``: the notebook of the magic tests on a cluster, started."""
        from tests.linear_fit import EVALUATE, SETUP, train_cell

        training = f"%%ddp_train {flags}\n" + train_cell(8).split("\n", 1)[1]
        cells = ["%load_ext nbddp", SETUP, training, EVALUATE, last_cell]
        return cls(new_notebook(cells=[new_code_cell(c) for c in cells], metadata=PYTHON3), folder)

    def assert_trained(self, timeout: float = 240) -> None:
        """The cells of :meth:`after_training` before the last ran: trained, the weights back in the kernel."""
        assert self.before_last.wait(timeout)
        trained = self.text(2)
        assert "succeeded in" in trained and "model loaded on the CPU" in trained, trained
        assert "kernel sees weight sum" in self.text(3)

    def text(self, index: int) -> str:
        """What cell ``index`` printed (streams and plain-text results)."""
        return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in self.nb.cells[index].outputs)

    def stop(self, join: float = 150) -> None:
        """Interrupt the kernel (the stop button) and wait for the thread to end."""
        from nbclient.util import run_sync

        run_sync(self.client.km.interrupt_kernel)()
        self.thread.join(join)
