"""Which notebook a kernel runs (its runs are named after it), from what each front end gives the kernel."""

import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from nbddp.doors.jupyter.session import notebook_in_command, session_notebook
from tests.conftest import PYTHON3

PY = "/usr/bin/python3"


@pytest.mark.parametrize("argv, notebook", [
    ([PY, "/usr/local/bin/papermill", "digits.ipynb", "out.ipynb", "-p", "lr", "0.1"], "digits.ipynb"),
    ([PY, "-m", "papermill", "--cwd", "w", "s3://b/in/digits.ipynb", "-"], "s3://b/in/digits.ipynb"),
    ([PY, "/usr/local/bin/papermill", "-", "out.ipynb"], None),  # the input comes from stdin
    ([PY, "/usr/local/bin/jupyter-nbconvert", "--to", "notebook", "--execute", "nb/digits.ipynb", "--output",
      "done.ipynb"], "nb/digits.ipynb"),
    ([PY, "/usr/local/bin/jupyter-nbconvert", "--execute", "--output=done.ipynb", "digits.ipynb"], "digits.ipynb"),
    ([PY, "/usr/local/bin/jupyter-execute", "digits.ipynb"], "digits.ipynb"),
    ([PY, "/usr/local/bin/jupyter-execute", "a.ipynb", "b.ipynb"], None),  # one kernel each: which is this one?
    (["C:\\Python\\Scripts\\jupyter-nbconvert.exe", "--execute", "digits.ipynb"], "digits.ipynb"),
    ([PY, "-m", "jupyter_server"], None),
    ([PY, "my_pipeline.py", "digits.ipynb"], None),  # a program of one's own: its arguments mean anything
    ([PY, "/usr/local/bin/jupyter-lab", "digits.ipynb"], None),  # (its kernels get JPY_SESSION_NAME)
    ([], None),
])
def test_the_notebook_a_command_line_executes(argv, notebook):
    assert notebook_in_command(argv) == notebook


def test_jupyter_servers_session_then_papermills_injected_path_then_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("JPY_PARENT_PID", raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    assert session_notebook(tmp_path) == tmp_path / "ddp_train.ipynb"
    assert session_notebook(tmp_path, {"PAPERMILL_INPUT_PATH": "/data/in/digits.ipynb"}) == tmp_path / "digits.ipynb"
    assert session_notebook(tmp_path, {"PAPERMILL_INPUT_PATH": "-"}) == tmp_path / "ddp_train.ipynb"
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/work/Untitled1.ipynb")
    assert session_notebook(tmp_path, {"PAPERMILL_INPUT_PATH": "x.ipynb"}) == tmp_path / "Untitled1.ipynb"


ASK = ("import pathlib\nfrom nbddp.doors.jupyter.session import session_notebook\n"
       "print('named', session_notebook(pathlib.Path.cwd(), globals()).stem)")


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    ["-m", "papermill", "digits.ipynb", "out.ipynb", "-k", "python3", "--no-progress-bar"],
    ["-m", "papermill", "digits.ipynb", "-", "-k", "python3", "--no-progress-bar", "--inject-input-path"],
    ["-m", "nbconvert", "--to", "notebook", "--execute", "digits.ipynb", "--output", "out.ipynb"],
    ["-m", "jupyter", "execute", "digits.ipynb", "--output", "out"],  # nbclient's command
])
def test_a_kernel_started_by_papermill_nbconvert_or_jupyter_execute_knows_its_notebook(tmp_path, command):
    parameters = new_code_cell("", metadata={"tags": ["parameters"]})
    nbformat.write(new_notebook(cells=[parameters, new_code_cell(ASK)], metadata=PYTHON3), tmp_path / "digits.ipynb")
    done = subprocess.run([sys.executable, *command], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    executed = done.stdout if "-" in command else (tmp_path / "out.ipynb").read_text()
    assert "named digits" in executed, executed
