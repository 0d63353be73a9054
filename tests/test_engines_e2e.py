"""Exported scripts of the example notebooks train across 2 real processes (gloo, CPU).

torch engine: ``torchrun --standalone --nproc-per-node=2 train.py``.
catalyst engine: ``python train.py`` (Catalyst's own mp.spawn).
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from nbddp.checkpoint import load_returns
from nbddp.doors.cli import main
from tests.conftest import EXAMPLES, PYTHON, kill_group, survivors

pytestmark = pytest.mark.slow


def run_in_own_group(argv, cwd, timeout=240):
    scratch = Path(cwd) / "tmp"  # a hand-run torchrun leaves torchelastic_* in TMPDIR: keep it in the test's folder
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(scratch)}
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
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"], tmp_path)
    assert proc.returncode == 0, out
    assert out.count("epoch 4 loss") == 2, out  # once per rank
    returns, _ = load_returns(tmp_path / "train.weights.pt")
    assert not any(k.startswith("module.") for k in returns["model"])  # DDP wrapper stripped
    assert accuracy(returns["model"], tmp_path) > 0.9


def test_catalyst_script_runs_with_python_on_two_processes(tmp_path):
    shutil.copy(EXAMPLES / "digits_catalyst.ipynb", tmp_path)
    assert main(["export", str(tmp_path / "digits_catalyst.ipynb"), "-o", str(tmp_path / "train.py"), "-p", "epochs", "3"]) == 0
    proc, out = run_in_own_group([PYTHON, "train.py"], tmp_path)
    assert proc.returncode == 0, out
    assert "[nbddp] rank 0/2 started" in out and "[nbddp] rank 1/2 started" in out
    assert "returning the runner's best checkpoint" in out
    returns, note = load_returns(tmp_path / "train.weights.pt")
    assert "best checkpoint" in note
    assert accuracy(returns["model"], tmp_path) > 0.85
