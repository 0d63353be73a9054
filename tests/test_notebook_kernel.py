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
