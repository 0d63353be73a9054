"""``papermill --engine nbddp``: papermill's parameters, output notebook, errors and exit status,
with the ``ddp-train`` cells run as a real DDP job (2 CPU ranks)."""

import subprocess
import sys

import nbformat
import papermill
import pytest

from tests.conftest import code, write_notebook
from tests.linear_fit import EVALUATE, SETUP, assert_matches, train_cell

pytestmark = pytest.mark.slow
OPTIONS = {"NBDDP_OPTIONS": "--cpu --nproc 2"}


def test_the_engine_is_registered_through_papermills_entry_point():
    from papermill.engines import papermill_engines

    assert papermill_engines.get_engine("nbddp").__name__ == "NbddpEngine"


def test_papermill_runs_the_training_as_ddp_with_its_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("NBDDP_OPTIONS", OPTIONS["NBDDP_OPTIONS"])
    write_notebook(tmp_path / "fit.ipynb", [code("lr = 0.01", "parameters"), code(SETUP),
                                             code(train_cell(8).replace("lr=0.05", "lr=lr")),
                                             code(EVALUATE + "\nprint('lr in the kernel', lr)")])
    nb = papermill.execute_notebook(str(tmp_path / "fit.ipynb"), str(tmp_path / "out.ipynb"),
                                    parameters={"lr": 0.05}, engine_name="nbddp", cwd=str(tmp_path),
                                    progress_bar=False)
    texts = ["".join(o.get("text", "") for o in c.get("outputs", [])) for c in nb.cells]
    assert "injected-parameters" in nb.cells[1].metadata.tags
    assert "[rank 1]" in texts[3] and "loaded the trained model" in texts[3]
    assert "lr in the kernel 0.05" in texts[4]
    assert [c.metadata.papermill.status for c in nb.cells] == ["completed"] * 5
    assert_matches(next((tmp_path / "runs").iterdir()) / "weights.pt", batch=16)  # lr=0.05 reached the ranks
    assert nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[4].outputs  # papermill wrote it


def test_a_failing_rank_is_a_papermill_execution_error_and_exit_1(tmp_path):
    write_notebook(tmp_path / "boom.ipynb", [code("lr = 0.05", "parameters"), code(SETUP), code(
        "#| ddp-train\nif nbddp.rank() == 1:\n    raise ValueError(f'bad lr {lr}')\ntorch.distributed.barrier()"),
        code("print('EVALUATION RAN')")])
    done = subprocess.run([sys.executable, "-m", "papermill", "--engine", "nbddp", "boom.ipynb", "out.ipynb",
                           "-p", "lr", "0.3"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, **OPTIONS})
    assert done.returncode == 1, done.stderr
    assert "PapermillExecutionError" in done.stderr and "rank 1 raised ValueError: bad lr 0.3" in done.stderr
    nb = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    statuses = [c.metadata.get("papermill", {}).get("status") for c in nb.cells if c.cell_type == "code"]
    assert statuses == ["completed", "completed", "completed", "failed", "pending"]
    assert "EVALUATION RAN" not in done.stdout + done.stderr
