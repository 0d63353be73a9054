"""Exported scripts of the example notebooks train across 2 real processes (gloo, CPU).

torch engine: ``torchrun --standalone --nproc-per-node=2 train.py`` (the fast tier's real-process test
of ``nbddp export``); catalyst engine: ``python train.py`` (Catalyst's own mp.spawn). The ranks are told
they are CPU ranks (``NBDDP_DEVICE=cpu``, as ``--cpu`` tells them), so that they are on a machine with
GPUs too. Scripts that an earlier nbddp exported keep working.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from nbddp.contracts.checkpoint import load_returns
from nbddp.doors.cli import main
from tests.conftest import EXAMPLES, PYTHON, code, cpu_rank, kill_group, survivors


def run_in_own_group(argv, cwd, timeout=240, env=None):
    scratch = Path(cwd) / "tmp"  # a hand-run torchrun leaves torchelastic_* in TMPDIR: keep it in the test's folder
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(scratch), **(env or {})}
    env.pop("NBDDP_RUN_DIR", None)
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        left = survivors(proc.pid)
    finally:
        kill_group(proc.pid)
    assert not left, f"processes of the run outlived it: {left}"
    return proc, out


def accuracy(weights, tmp_path):
    """Evaluate the returned weights on the CPU on the held-out digits."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    _, X_test, _, y_test = train_test_split(X, y, test_size=0.25, random_state=0, stratify=y)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model.load_state_dict(weights)
    with torch.no_grad():
        return (model(X_test).argmax(1) == y_test).float().mean().item()


def test_torch_script_runs_under_torchrun_on_two_processes(tmp_path):
    shutil.copy(EXAMPLES / "digits_torch.ipynb", tmp_path)
    assert main(["export", str(tmp_path / "digits_torch.ipynb"), "-o", str(tmp_path / "train.py"), "-p", "epochs", "4"]) == 0
    proc, out = run_in_own_group(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"], tmp_path,
        env=cpu_rank())
    assert proc.returncode == 0, out
    assert out.count("epoch 4 loss") == 2, out  # once per rank
    returns, _ = load_returns(tmp_path / "train.weights.pt")
    assert not any(k.startswith("module.") for k in returns["model"])  # DDP wrapper stripped
    assert accuracy(returns["model"], tmp_path) > 0.9


def test_an_exported_script_run_by_hand_names_the_notebook_cell_in_its_traceback(tmp_path, notebook):
    """Under a person's own launcher (here plain ``python``, one rank), the rank's traceback reads each frame of the
    script back to the notebook from the map beside it; without the map, it is Python's own."""
    path = notebook([code("import torch, nbddp\nscale = 2", "ddp"),
                     code("#| ddp-train\nvalues = [scale]\n\nraise ValueError(f'bad batch {values}')")])
    assert main(["export", str(path), "-o", str(tmp_path / "fail.py")]) == 0
    proc, out = run_in_own_group([PYTHON, "fail.py"], tmp_path, env=cpu_rank(), timeout=60)
    assert proc.returncode == 1 and "ValueError: bad batch [2]" in out, out
    assert re.search(rf'File ".*fail.py", line \d+ \[{re.escape(str(path))}, cell 2, line 4\], in <module>', out), out
    (tmp_path / "fail.py.map.json").unlink()
    proc, out = run_in_own_group([PYTHON, "fail.py"], tmp_path, env=cpu_rank(), timeout=60)
    assert proc.returncode == 1 and "ValueError: bad batch [2]" in out and "cell 2" not in out, out


@pytest.mark.beside  # long (Catalyst's imports in three processes), asserts no timing: evens out .ci/run's lanes
@pytest.mark.slow
def test_catalyst_script_runs_with_python_on_two_processes(tmp_path):
    shutil.copy(EXAMPLES / "digits_catalyst.ipynb", tmp_path)
    assert main(["export", str(tmp_path / "digits_catalyst.ipynb"), "-o", str(tmp_path / "train.py"), "-p", "epochs", "3"]) == 0
    # Under a TMPDIR too long for a Unix socket (JupyterHub's and batch systems' can be): torch.multiprocessing
    # sends the loaders' tensors to Catalyst's ranks through sockets in it.
    long_temp = tmp_path / ("a-temp-folder-as-long-as-some-jupyterhubs-and-batch-systems-make-" * 2)
    long_temp.mkdir()
    proc, out = run_in_own_group([PYTHON, "train.py"], tmp_path,  # as `nbddp export --cpu` says
                                 env={**cpu_rank(nproc=2), "TMPDIR": str(long_temp)})
    assert proc.returncode == 0, out
    assert "[nbddp] rank 0/2 started" in out and "[nbddp] rank 1/2 started" in out
    assert "returning the runner's best checkpoint" in out
    returns, note = load_returns(tmp_path / "train.weights.pt")
    assert "best checkpoint" in note
    assert accuracy(returns["model"], tmp_path) > 0.85
    assert not list(Path("/tmp").glob(f"nbddp-catalyst-{proc.pid}-*"))  # its short temp folder went with it


#: What nbddp 0.1 exported (before the package was split into subpackages): its import path must keep working.
OLD_SCRIPT = """\
# Generated by nbddp 0.1.0 from nb.ipynb (cells 1, 2); engine: torch.
import nbddp.runtime as _nbddp
_nbddp.start()  # joins the process group (nccl on GPUs, gloo on CPU) under torchrun

# %% cell 1 [ddp]
import torch, nbddp
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)


if __name__ == '__main__':

    # %% cell 2 [ddp-train]
    ddp = nbddp.prepare(model)
    print('rank', nbddp.rank(), 'of', nbddp.world_size())

    _nbddp.finish(globals(), returns=['model'])  # rank 0 saves the returned state
"""


def test_a_script_an_earlier_nbddp_exported_still_runs(tmp_path):
    (tmp_path / "old.py").write_text(OLD_SCRIPT)
    proc, out = run_in_own_group([PYTHON, "old.py"], tmp_path)
    assert proc.returncode == 0 and "rank 0 of 1" in out, out
    returns, _ = load_returns(tmp_path / "old.weights.pt")
    assert set(returns["model"]) == {"weight", "bias"}
    older = OLD_SCRIPT.replace("_nbddp.start()", "_nbddp.start('catalyst')")  # 0.1's Catalyst form
    (tmp_path / "older.py").write_text(older)
    proc, out = run_in_own_group([PYTHON, "older.py"], tmp_path)
    assert proc.returncode == 1 and "export it again" in out, out
