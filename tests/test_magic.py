"""``%%ddp_train`` in a real ipykernel, driven by nbclient, papermill and the Jupyter protocol."""

import json
import os
import queue
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbclient.util import run_sync
from nbformat.v4 import new_code_cell, new_notebook

from tests.conftest import alive, descendants, wait_until

pytestmark = pytest.mark.slow

SETUP = ("#| ddp\nimport time\nimport torch\nimport nbddp\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 2)\n"
         "X, Y = torch.randn(64, 4), torch.randint(0, 2, (64,))")
TRAIN = (
    "%%ddp_train --cpu\n"
    "ddp_model = nbddp.prepare(model)\n"
    "opt = torch.optim.SGD(ddp_model.parameters(), lr=lr)\n"
    "loader = nbddp.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8))\n"
    "for epoch in range(epochs):\n"
    "    for x, y in loader:\n"
    "        opt.zero_grad()\n"
    "        torch.nn.functional.cross_entropy(ddp_model(x), y).backward()\n"
    "        opt.step()\n"
    "    nbddp.log(epoch=epoch + 1, epochs=epochs, loss=0.5)\n"
    "    print(f'rank {nbddp.rank()} lr={lr} epoch {epoch}')"
)


def notebook(*sources, parameters=None):
    cells = [new_code_cell("%load_ext nbddp")]
    if parameters is not None:
        cells.append(new_code_cell(parameters, metadata={"tags": ["parameters"]}))
    cells += [new_code_cell(s) for s in sources]
    return new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


def text_of(cell) -> str:
    parts = []
    for output in cell.outputs:
        parts.append(output.get("text", "") or output.get("data", {}).get("text/plain", ""))
        parts.extend(output.get("traceback", []))
    return "\n".join(parts)


def run_dirs(folder):
    return sorted((folder / "runs").iterdir()) if (folder / "runs").exists() else []


def test_happy_path_weights_come_back_and_evaluate_on_the_cpu_and_every_ranks_lines_come_as_they_are_printed(tmp_path):
    """The weights come back and the kernel evaluates them on the CPU. nbclient (papermill, ``jupyter execute``)
    renders no widgets: the ranks' lines come as text outputs while the cell runs (a second run, on the warm
    ranks), each line once, with an empty HTML part that front ends rendering HTML show as nothing."""
    ticks = "%%ddp_train --cpu\nfor i in range(6):\n    print('tick', i, flush=True)\n    time.sleep(0.5)"
    nb = notebook(SETUP, "lr = 0.5\nepochs = 3\nbefore = model.weight.detach().clone()", TRAIN,
                  "changed = not torch.equal(before, model.weight)\nprint('changed', changed, model.weight.device)", ticks)
    seen: list[tuple[float, str]] = []
    ended: dict[int, float] = {}

    class Recording(NotebookClient):
        def process_message(self, msg, cell, cell_index):
            data = msg["content"].get("data", {})
            if cell_index == 5 and msg["msg_type"] in ("stream", "display_data"):
                seen.append((time.monotonic(), msg["content"].get("text") or data.get("text/plain", "")))
            return super().process_message(msg, cell, cell_index)

    Recording(nb, timeout=300, resources={"metadata": {"path": str(tmp_path)}},
              on_cell_executed=lambda cell, cell_index, execute_reply: ended.setdefault(cell_index, time.monotonic())
              ).execute()
    train_out = text_of(nb.cells[3])
    for rank in (0, 1):
        assert train_out.count(f"[rank {rank}] rank {rank} lr=0.5 epoch 2") == 1  # (as it came, and not again)
    assert "[nbddp] final metrics: loss=0.5" in train_out and "epoch=" not in train_out  # once, no counters
    assert train_out.count("[nbddp] succeeded in") == 1 and "· model loaded on the CPU · run dir runs/" in train_out
    assert "changed True cpu" in text_of(nb.cells[4])
    # The live view (widgets) was replaced by its static copy, which needs no kernel to render.
    [view] = [o for o in nb.cells[3].outputs if "nbddp-snapshot" in o.get("data", {}).get("text/html", "")]
    assert "application/vnd.jupyter.widget-view+json" not in view["data"]
    assert 'class="nbddp-snapshot"' in view["data"]["text/html"] and "data:image/svg+xml;base64," in view["data"]["text/html"]
    run_dir = run_dirs(tmp_path)[0]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "succeeded" and result["parameters"] == {"lr": 0.5, "epochs": 3}

    first_tick = next(at for at, text in seen if "[rank 1] tick 0" in text)
    assert ended[5] - first_tick > 1.5, seen  # shown as it came, not when the cell ended
    out = text_of(nb.cells[5])
    assert all(out.count(f"[rank {r}] tick {i}") == 1 for r in (0, 1) for i in range(6)), out
    mirrored = [o for o in nb.cells[5].outputs if "tick" in o.get("data", {}).get("text/plain", "")]
    assert mirrored and all(o["data"]["text/html"] == '<div class="nbddp-text-copy"></div>' for o in mirrored)


def test_non_plain_free_variable_is_rejected_before_launch(tmp_path):
    nb = notebook(SETUP, "helper = lambda v: v * 2", "%%ddp_train --cpu\nprint(helper(1))")
    with pytest.raises(CellExecutionError) as info:
        NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    message = str(info.value)
    assert "'helper' is a function in the kernel" in message and "'#| ddp' cell" in message
    assert not run_dirs(tmp_path)


def test_papermill_parameters_reach_every_rank_and_logs_land_in_the_output(tmp_path):
    import papermill

    nb = notebook(SETUP, TRAIN, "print('evaluated', float(model.weight.sum()) != 0)", parameters="lr = 0.1\nepochs = 2")
    nbformat.write(nb, tmp_path / "in.ipynb")
    papermill.execute_notebook(str(tmp_path / "in.ipynb"), str(tmp_path / "out.ipynb"), parameters={"lr": 0.01},
                               cwd=str(tmp_path), progress_bar=False, kernel_name="python3")
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    train = next(c for c in out.cells if c.source.startswith("%%ddp_train"))
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} lr=0.01 epoch 1" in text_of(train)
    assert "evaluated True" in text_of(out.cells[-1])


def test_rank_failure_raises_in_the_cell_and_papermill_marks_it(tmp_path):
    import papermill
    from papermill.exceptions import PapermillExecutionError

    failing = ("%%ddp_train --cpu\n"
               "model = nbddp.prepare(model)\n"
               "for step in range(100):\n"
               "    if step == 3 and nbddp.rank() == 1:\n"
               "        raise RuntimeError('rank one broke')\n"
               "    torch.distributed.barrier()")
    nb = notebook(SETUP, failing, "print('SHOULD NOT RUN')")
    nbformat.write(nb, tmp_path / "in.ipynb")
    with pytest.raises(PapermillExecutionError) as info:
        papermill.execute_notebook(str(tmp_path / "in.ipynb"), str(tmp_path / "out.ipynb"), cwd=str(tmp_path),
                                   progress_bar=False, kernel_name="python3")
    assert info.value.ename == "RunFailed"
    assert "rank 1 raised RuntimeError: rank one broke" in info.value.evalue
    traceback = "\n".join(info.value.traceback)
    # Line 5 of the cell as the notebook shows it (its %%ddp_train line is line 1, as for nbddp run)
    assert "the %%ddp_train cell, line 5" in traceback and "raise RuntimeError('rank one broke')" in traceback
    assert "cell_job.py" not in traceback  # the message, not nbddp's own stack
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert out.cells[-1].outputs == []  # the evaluation after the failed cell never ran
    assert any("An Exception was encountered" in c.source for c in out.cells if c.cell_type == "markdown")
    failed = next(c for c in out.cells if c.source.startswith("%%ddp_train"))
    assert any(o.output_type == "error" and o.ename == "RunFailed" for o in failed.outputs)
    (run_dir,) = run_dirs(tmp_path)
    assert json.loads((run_dir / "result.json").read_text())["status"] == "failed"


LONG = "%%ddp_train --cpu\nfor step in range(100000):\n    print('step', step, flush=True)\n    time.sleep(0.1)"


def _rank_pids(run_dir) -> set[int]:
    pids = set()
    for log in (run_dir / "logs").glob("rank-*.log"):
        pids |= {int(p) for p in re.findall(r"started \(pid (\d+)\)", log.read_text(errors="replace"))}
    return pids


def _start_long_training(tmp_path, flags: str = ""):
    nb = notebook(SETUP, LONG.replace("--cpu", f"--cpu {flags}".strip()))
    client = NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(tmp_path)}})
    errors = []
    ready = threading.Event()

    def execute():
        with client.setup_kernel():
            for index in range(2):
                client.execute_cell(nb.cells[index], index)
            ready.set()
            try:
                client.execute_cell(nb.cells[2], 2)
            except Exception as exc:  # noqa: BLE001 - inspected by the test
                errors.append(exc)

    thread = threading.Thread(target=execute, daemon=True)
    thread.start()
    assert ready.wait(120)

    def training() -> bool:
        dirs = run_dirs(tmp_path)
        log = dirs[0] / "logs" / "rank-1.log" if dirs else None
        return bool(dirs) and len(_rank_pids(dirs[0])) == 2 and log.exists() and "step 3" in log.read_text()

    wait_until(training, 120, "both ranks started and rank 1 at its step 3")
    (run_dir,) = run_dirs(tmp_path)
    kernel_pid = client.km.provisioner.process.pid
    return client, thread, errors, run_dir, descendants(kernel_pid) | _rank_pids(run_dir)


def _gone_within(pids, seconds, what: str) -> None:
    """Every one of ``pids`` ends within ``seconds`` (``what`` names it), or the test fails naming those left."""
    wait_until(lambda: not any(alive(p) for p in pids), seconds, what,
               detail=lambda: f"still alive: {sorted(p for p in pids if alive(p))}")


def test_kernel_interrupt_stops_every_fresh_rank(tmp_path):
    """(Warm ranks stop the run and stay for the next one: tests/test_warm.py.)"""
    client, thread, errors, run_dir, pids = _start_long_training(tmp_path, "--fresh")
    assert len(pids) >= 3  # the launcher and both ranks
    run_sync(client.km.interrupt_kernel)()  # the stop button: SIGINT to the kernel's process group
    _gone_within(pids, 10, "the stop button ended the kernel's fresh ranks and their launcher")
    thread.join(60)
    assert errors and errors[0].ename == "KeyboardInterrupt"
    assert json.loads((run_dir / "result.json").read_text())["status"] == "interrupted"


def test_kernel_restart_leaves_no_rank_alive(tmp_path):
    """A restart SIGKILLs the kernel: it gets no chance to clean up, yet no rank and no pool folder outlive it.

    (Killed directly, as a restart does: calling the client's restart from this thread while its own
    thread runs the cell raced nbclient's cleanup, which closed the ZMQ context the restart used.)
    """
    client, thread, errors, run_dir, pids = _start_long_training(tmp_path)
    kernel_pid = client.km.provisioner.process.pid
    os.kill(kernel_pid, signal.SIGKILL)
    _gone_within(pids, 10, "the ranks ended with their SIGKILLed kernel")
    thread.join(60)  # nbclient's liveness poll ends the waiting cell (DeadKernelError)
    assert not thread.is_alive() and errors and type(errors[0]).__name__ == "DeadKernelError", errors
    from nbddp.contracts.pool_dir import FOLDER_PREFIX

    wait_until(lambda: not list(Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}{kernel_pid}-*")), 10,
               "the killed kernel's warm-pool folder removed once its ranks ended")


class ProtocolKernel:
    """A kernel driven with raw execute_requests carrying ``cellId``, as JupyterLab sends them.

    Over IPC sockets in a private temp folder short enough for them, as nbddp's own kernels are
    (:meth:`nbddp.doors.notebook_kernel.NotebookKernel.kernel_manager`): TCP's ports are chosen free and bound by the
    kernel a moment later, a race with the other lanes' kernels, ranks and clusters on a busy CI machine."""

    def __init__(self, cwd, timeout: float = 120, kernel_name: str = "python3"):
        from jupyter_client import KernelManager

        from nbddp.contracts.process_groups import owned_temp_dir

        self.timeout = timeout
        """Seconds to wait for the cell's next message (a cell may be quiet that long, not longer)."""
        self.sockets = owned_temp_dir("nbddp-test-kernel-", for_sockets=True)
        self.km = KernelManager(kernel_name=kernel_name, transport="ipc", ip=os.path.join(self.sockets, "k"))
        self.km.start_kernel(cwd=str(cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)  # (a kernel's imports beside .ci/run's other lanes on 2 cores)

    def execute(self, code, cell_id=None):
        self.start_execute(code, cell_id)
        return self.finish_execute()

    def start_execute(self, code, cell_id=None):
        content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": True}
        self.msg = self.kc.session.msg("execute_request", content, metadata={"cellId": cell_id} if cell_id else {})
        self.read: list[dict] = []
        """The cell's messages read before :meth:`finish_execute` (:meth:`wait_for_display`)."""
        self.kc.shell_channel.send(self.msg)

    def _next(self, timeout: float) -> dict | None:
        """The running cell's next message (``None``: another request's)."""
        reply = self.kc.get_iopub_msg(timeout=timeout)
        return reply if reply["parent_header"].get("msg_id") == self.msg["header"]["msg_id"] else None

    def wait_for_display(self, timeout: float = 60):
        """Until the running cell displays something (the live view, once the kernel follows the job): an event of the
        kernel's, where the ranks' own files say only that the job runs."""
        def displayed():
            try:
                reply = self._next(1)
            except queue.Empty:
                return False
            if reply is not None:
                self.read.append(reply)
            return reply is not None and reply["msg_type"] in ("display_data", "update_display_data")

        wait_until(displayed, timeout, "the cell displayed its view", every=0)

    def finish_execute(self):
        """Everything the cell printed, displayed (its final text copy) or raised, once it is done."""
        text, displays = [], {}
        while True:
            reply = self.read.pop(0) if getattr(self, "read", None) else self._next(self.timeout)
            if reply is None:
                continue
            kind, content = reply["msg_type"], reply["content"]
            if kind == "execute_input":
                self.count = content["execution_count"]  # the cell's In [N]
            elif kind == "stream":
                text.append(content["text"])
            elif kind in ("display_data", "update_display_data"):  # the live view's text/plain copy
                key = content.get("transient", {}).get("display_id") or len(displays)
                displays[key] = content["data"].get("text/plain", "")
            elif kind == "error":
                text.append("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                return "\n".join(displays.values()) + "\n" + "".join(text)

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)  # as a front end does: the kernel exits normally (atexit runs)
        shutil.rmtree(self.sockets, ignore_errors=True)


def test_help_alone_in_a_cell_and_errors_that_name_the_cell_as_the_notebook_shows_it(tmp_path):
    """``%%ddp_train --help`` alone in a cell (as README writes it) prints the help; an empty training cell
    says so; a syntax error is named by the cell's ``In [N]`` (or as the %%ddp_train cell), not a count of its own."""
    kernel = ProtocolKernel(tmp_path)
    try:
        kernel.execute("%load_ext nbddp")
        help_text = kernel.execute("%%ddp_train --help")
        assert "usage: %%ddp_train" in help_text and "--fresh" in help_text and "--dry-run" in help_text
        assert "the cell has no training code" in kernel.execute("%%ddp_train --cpu\n\n")
        kernel.execute("#| ddp\nimport torch\nx = [1,\n", "broken")  # the kernel itself refuses it too
        broken = kernel.count
        out = kernel.execute("%%ddp_train --dry-run\nprint(x)", "train")
        assert f"In [{broken}], line 3: SyntaxError" in out, out
        kernel.execute("#| ddp\nimport torch\nx = [1]", "broken")  # fixed: the same cell id
        out = kernel.execute("%%ddp_train --dry-run\nprint(x\nprint(2)", "train")
        assert "the %%ddp_train cell, line 2: SyntaxError" in out, out
    finally:
        kernel.close()


def test_rerunning_an_edited_ddp_cell_replaces_its_old_version(tmp_path):
    kernel = ProtocolKernel(tmp_path)
    try:
        kernel.execute("%load_ext nbddp", "c0")
        kernel.execute("#| ddp\nimport torch\nmodel = torch.nn.Linear(2, 2)\nvalue = 'first version'", "c1")
        kernel.execute("#| ddp\nextra = 1", "c2")
        kernel.execute("#| ddp\nimport torch\nmodel = torch.nn.Linear(2, 2)\nvalue = 'second version'", "c1")
        script = kernel.execute("%%ddp_train --dry-run --cpu\nprint(value, extra)", "c3")
        assert "value = 'second version'" in script and "first version" not in script
        assert script.index("second version") < script.index("extra = 1")  # keeps its place
        assert "# %% In [4] [ddp]" in script and "# %% the %%ddp_train cell [ddp-train]" in script
        kernel.execute("extra = 5  # no longer a ddp cell", "c2")
        script = kernel.execute("%%ddp_train --dry-run --cpu\nprint(value, extra)", "c3")
        assert "extra = 1" not in script and "extra = 5" in script  # now a plain value from the kernel
        assert not run_dirs(tmp_path)  # --dry-run launched nothing
        out = kernel.execute("%%ddp_train --cpu\nprint('ranks see', value, extra)", "c3")
        assert "[rank 1] ranks see second version 5" in out, out
    finally:
        kernel.close()


def test_nbddp_kill_stops_a_kernels_run_but_not_the_kernel(tmp_path):
    from nbddp.job import registry

    client, thread, errors, run_dir, pids = _start_long_training(tmp_path)
    live = registry.find(run_dir.name)
    assert live.owner == "kernel"
    assert registry.kill(live)
    _gone_within(_rank_pids(run_dir), 10, "nbddp kill ended the kernel's ranks")
    thread.join(60)
    # The kernel answered the cell with RunInterrupted: it was not killed with its run.
    assert errors and errors[0].ename == "RunInterrupted" and "nbddp kill" in errors[0].evalue


@pytest.mark.waits  # mostly a timeout or a mid-training signal: runs beside the rest in .ci/run
def test_papermill_execution_timeout_leaves_no_rank(tmp_path):
    """(The limit, 20 s, is the cell's, starting the ranks included: 10 s once fell before a loaded machine had
    started them, leaving no rank to check.)"""
    import papermill

    nbformat.write(notebook(SETUP, LONG), tmp_path / "in.ipynb")
    from nbclient.exceptions import CellTimeoutError
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises((CellTimeoutError, PapermillExecutionError)) as info:
        papermill.execute_notebook(str(tmp_path / "in.ipynb"), str(tmp_path / "out.ipynb"), cwd=str(tmp_path),
                                   progress_bar=False, kernel_name="python3", execution_timeout=20)
    assert "timed out" in str(info.value).lower() or "timeout" in type(info.value).__name__.lower()
    (run_dir,) = run_dirs(tmp_path)
    pids = _rank_pids(run_dir)
    assert len(pids) == 2
    _gone_within(pids, 10, "papermill's execution timeout ended both ranks")


def test_launch_options_of_nbddp_run_work_in_the_magic(tmp_path):
    """-p, --max-restarts (resuming from the checkpoint), --idle-timeout and bad values: the same names and
    meanings as in `nbddp run`."""
    fail_once = ("%%ddp_train --cpu --max-restarts 1 -p lr 0.25\n"
                 "done = nbddp.restore(model=model)\n"
                 "print('attempt', nbddp.restart_count(), 'starts at epoch', done.get('epoch', -1) + 1, flush=True)\n"
                 "for epoch in range(done.get('epoch', -1) + 1, 2):\n"
                 "    if epoch == 1 and nbddp.rank() == 1 and nbddp.restart_count() == 0:\n"
                 "        raise RuntimeError('the first attempt fails')\n"
                 "    torch.distributed.barrier()  # as a training step would: rank 0 can't save ahead\n"
                 "    nbddp.save_checkpoint(model=model, epoch=epoch)\n"
                 "print('trained with', lr, flush=True)")
    nb = notebook(SETUP, "lr = 0.1", fail_once, "%%ddp_train --cpu -p nope 1\nprint(lr)",
                  "%%ddp_train --cpu --nproc 0\nprint(lr)", "%%ddp_train --cpu --idle-timeout 3\ntime.sleep(600)",
                  "%%ddp_train --cpu -p lr abc\nprint(lr)")
    NotebookClient(nb, timeout=300, allow_errors=True, resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert "[rank 1] trained with 0.25" in text_of(nb.cells[3]), text_of(nb.cells[3])
    assert "[rank 1] attempt 1 starts at epoch 1" in text_of(nb.cells[3])  # resumed from epoch 0's save
    first = json.loads((run_dirs(tmp_path)[0] / "result.json").read_text())
    assert first["status"] == "succeeded" and first["restarts"] == 1
    assert first["overrides"] == {"lr": 0.25} and first["command"].startswith("%%ddp_train --cpu --max-restarts 1")
    assert "-p nope: the training code takes no such value from the kernel; it takes lr." in text_of(nb.cells[4])
    assert "--nproc 0: need at least 1 process" in text_of(nb.cells[5])
    stalled = text_of(nb.cells[6])
    assert "RunTimeout" in stalled and "(--idle-timeout)" in stalled
    assert ("-p lr abc: the kernel's lr is 0.1, a number, and 'abc' reads as no Python literal (a typo?). Give a "
            "number, or quote the text to pass it as it is: -p lr \"'abc'\".") in text_of(nb.cells[7])  # (as nbddp run)
    assert len(run_dirs(tmp_path)) == 2  # the refused cells launched nothing


def test_where_widgets_dont_render_the_ending_is_the_cells_last_output_and_logged_last(tmp_path):
    """``papermill --log-output`` (text only): the view's first line, every rank's lines, then the ending, in the
    executed notebook and in papermill's log (which logs new outputs only, never an updated one)."""
    import subprocess
    import sys

    train = "%%ddp_train --cpu --nproc 2\nfor epoch in range(2):\n    nbddp.log(epoch=epoch + 1, epochs=2, loss=0.5)\n" \
            "    print('epoch', epoch)"
    nbformat.write(notebook(SETUP, train), tmp_path / "digits_magic.ipynb")
    done = subprocess.run([sys.executable, "-m", "papermill", "digits_magic.ipynb", "out.ipynb", "--log-output",
                           "--no-progress-bar", "-k", "python3"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    cell = nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[2]
    texts = [o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.outputs]
    assert texts[0].startswith("[nbddp] training on 2 processes (this front end does not render widgets: every rank's "
                               "lines follow as text)"), texts  # the reason, not "needs ipywidgets" (it's installed)
    assert texts[-1].startswith("[nbddp] succeeded in") and "final metrics: loss=0.5" in texts[-1], texts
    assert "[rank 1] epoch 1" in "\n".join(texts[1:-1]) and not any("succeeded" in t for t in texts[:-1]), texts
    log = done.stderr
    assert log.count("[nbddp] succeeded in") == 1, log
    (run_dir,) = run_dirs(tmp_path)
    assert run_dir.name.startswith("digits_magic-"), run_dir  # named after the notebook papermill ran
    assert log.index("[nbddp] training on 2 processes") < log.index("[rank 1] epoch 1") \
        < log.index("[nbddp] succeeded in") < log.index("[nbddp] final metrics: loss=0.5"), log


#: A setup the warm ranks keep, and a training on it whose weights a fresh run must give bit for bit.
EXEC_SETUP = "#| ddp\nimport torch, nbddp\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\ndata = list(range(10))"
EXEC_TRAIN = ("%%ddp_train --cpu --nproc 2\nddp = nbddp.prepare(model)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
              "for _ in range(3):\n    opt.zero_grad()\n    ddp(torch.ones(2, 4)).sum().backward()\n    opt.step()")


@pytest.mark.slow
def test_ddp_exec_runs_a_cell_on_the_warm_ranks_in_their_kept_state_and_what_it_changed_is_undone(tmp_path):
    """%%ddp_exec on real warm ranks: every rank's output labelled, one rank only, a collective, an error mapped to
    the cell, a change to the kept state undone (the next run's weights a fresh run's, bit for bit), --keep."""
    from nbddp.doors.jupyter.magics import NO_WARM_RANKS

    kernel = ProtocolKernel(tmp_path, timeout=180)
    try:
        kernel.execute("%load_ext nbddp")
        none = kernel.execute("%%ddp_exec\nprint('never')")
        assert NO_WARM_RANKS in none and "never" not in none, none
        kernel.execute(EXEC_SETUP, "setup")
        assert "succeeded in" in kernel.execute(EXEC_TRAIN, "train")
        both = kernel.execute("%%ddp_exec\nprint('len', len(data), 'rank', nbddp.rank(), flush=True)", "look")
        assert "[rank 0] len 10 rank 0" in both and "[rank 1] len 10 rank 1" in both, both
        one = kernel.execute("%%ddp_exec --ranks 1\nprint('only', nbddp.rank(), flush=True)", "one")
        assert "[rank 1] only 1" in one and "only 0" not in one, one
        summed = kernel.execute("%%ddp_exec\nt = torch.tensor([nbddp.rank() + 1.0])\n"
                                "torch.distributed.all_reduce(t)\nprint('sum', t.item(), flush=True)", "sum")
        assert "[rank 0] sum 3.0" in summed and "[rank 1] sum 3.0" in summed, summed
        failed = kernel.execute("%%ddp_exec --ranks 0\nx = 1\nraise ValueError('looked')", "fail")
        assert "rank 0 raised ValueError: looked" in failed and "the %%ddp_exec cell, line 3" in failed, failed
        changed = kernel.execute("%%ddp_exec\nwith torch.no_grad():\n    model.weight.fill_(7.0)\ndata.append(99)",
                                 "change")
        assert "succeeded in" in changed, changed
        warm = kernel.execute(EXEC_TRAIN, "train")
        assert "on a warm rank" in warm, warm
        kernel.execute("warm = model.weight.detach().clone()")
        assert "succeeded in" in kernel.execute(EXEC_TRAIN.replace("--nproc 2", "--nproc 2 --fresh"), "train")
        assert "SAME True" in kernel.execute("print('SAME', torch.equal(warm, model.weight.detach()))")
        kept = kernel.execute("%%ddp_exec --keep\nscale = 2.0", "keep")
        assert "kept: the cell is a setup cell of every later %%ddp_train" in kept, kept
        later = kernel.execute("%%ddp_train --cpu --nproc 2\nprint('scale', scale, flush=True)", "train")
        assert "[rank 1] scale 2.0" in later, later
    finally:
        kernel.close()
