"""The kernel beside the job: what it reads of a failing cell, and the error it raises in the training cell's place."""

import pytest

from nbddp.doors.notebook_kernel import cell_line, raise_code
from nbddp.contracts.errors import RunFailed, RunTimeout

# IPython's traceback of In[7] calling a function defined in In[3], as the kernel sends it (with its colours).
TRACEBACK = ("\x1b[0;31mAssertionError\x1b[0m                            Traceback (most recent call last)\n"
             "Cell \x1b[0;32mIn[7], line 2\x1b[0m\n      1 x = 1\n\x1b[0;32m----> 2\x1b[0m check(x)\n\n"
             "Cell \x1b[0;32mIn[3], line 4\x1b[0m, in \x1b[0;36mcheck\x1b[0;34m(x)\x1b[0m\n"
             "\x1b[0;32m----> 4\x1b[0m \x1b[38;5;28;01massert\x1b[39;00m x > 2\n")


@pytest.mark.parametrize("count, line", [(7, 2), (3, 4), (5, None), (None, None)])
def test_the_line_is_the_failing_cells_own(count, line):
    assert cell_line(TRACEBACK, count) == line


@pytest.mark.parametrize("error", [
    RunFailed("cell 5 raised", exc_type="AssertionError", exc_message="(True, 39.61)", cell=5, line=3),
    RunTimeout("too slow", exit_code=124, rank=1, run_dir="/runs/r"),
])
def test_the_error_raised_in_the_training_cells_place_is_the_same_error(error):
    with pytest.raises(type(error)) as raised:
        exec(raise_code(error), {})
    assert str(raised.value) == str(error)
    assert [getattr(raised.value, name) for name in error.FIELDS] == [getattr(error, name) for name in error.FIELDS]


def test_a_ctrl_c_while_the_kernel_runs_a_cell_ends_the_cell_as_a_stop_button_and_leaves_no_task(tmp_path, caplog):
    """The cause of a papermill Ctrl-C that ended with ``DeadKernelError`` instead of ``Aborted!`` (1 run in 3
    under load): the interrupted cell's task stayed pending on nbclient's loop and, when the loop next ran to shut
    the kernel down, found it gone; when it didn't, it recorded the kernel's ``KeyboardInterrupt`` in the cell, as
    papermill's own engine does. Made deterministic here: the loop runs past the task's 1 s alive check after the
    kernel is gone. (A real kernel; the job beside it is a stand-in that trains no cell.)"""
    import asyncio
    import os
    import signal
    import threading

    import nbformat
    from jupyter_core.utils import ensure_event_loop
    from nbclient import NotebookClient

    from nbddp.doors.notebook_kernel import TrainingCells

    class Client(TrainingCells, NotebookClient):
        pass

    class NoTraining:
        def trains(self, index: int) -> bool:
            return False

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import time; time.sleep(30)")])
    client = Client(nb, kernel_name="python3", shutdown_kernel="immediate",
                    resources={"metadata": {"path": str(tmp_path)}})
    client.nbddp_kernel = NoTraining()
    loop = ensure_event_loop()
    with client.setup_kernel():
        timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            client.execute_cell(nb.cells[0], 0)
        timer.join()
        left = [task for task in asyncio.all_tasks(loop) if not task.done()]
        loop.run_until_complete(client.km.shutdown_kernel(now=True))
        loop.run_until_complete(asyncio.sleep(1.5))  # past the cell task's check that the kernel is alive
    assert left == []
    assert "Kernel died" not in caplog.text  # (nbclient's line as the task found it gone)
    assert [o.get("ename") for o in nb.cells[0].outputs if o.output_type == "error"] == ["KeyboardInterrupt"]


def _saved_with(path, kernel):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[new_code_cell("#| ddp-train\nimport nbddp\nnbddp.log(x=1)")], metadata={
        "kernelspec": {"name": kernel, "display_name": kernel, "language": "python"}})
    nbformat.write(nb, path)
    return path


def test_a_notebooks_kernel_is_its_own_and_the_nbddp_kernel_not_installed_here_is_the_plain_one(tmp_path, monkeypatch):
    """The nbddp kernel only starts the warm ranks' starter sooner, which beside a job it doesn't: nbddp runs a
    notebook saved with it in this Python's plain kernel. Another kernel not installed here is said before anything
    starts, naming it and those that are (Jupyter's own kernelspecs, in the test's folders)."""
    from nbddp.doors.cli import main
    from nbddp.doors.jupyter.kernelspec import install
    from nbddp.doors.notebook_kernel import kernel_for
    from nbddp.contracts.errors import NotebookError
    from nbddp.notebook.reader import read_notebook

    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "user"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "path"))
    saved = read_notebook(_saved_with(tmp_path / "nb.ipynb", "nbddp"))
    assert kernel_for(saved) == "python3"
    install()
    assert kernel_for(saved) == "python3"  # (installed or not: its kernelspec may name another environment's Python)
    assert kernel_for(read_notebook(_saved_with(tmp_path / "cased.ipynb", "Python3"))) == "python3"  # (as Jupyter)
    missing = _saved_with(tmp_path / "theirs.ipynb", "conda-env-theirs-py")
    with pytest.raises(NotebookError, match=r"theirs.ipynb: its kernel 'conda-env-theirs-py' is not installed here "
                                            r"\(installed: [^)]*python3[^)]*\)\. Install it \(`python -m ipykernel "
                                            r"install --user --name conda-env-theirs-py`"):
        kernel_for(read_notebook(missing))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "theirs.ipynb", "--cpu"]) == 2  # (before anything starts: no run dir)
    assert not (tmp_path / "runs").exists()
