"""Notebooks written as PyTorch's DDP tutorial teaches (``mp.spawn(fn, args, nprocs)``, the function joining its
own group) run on nbddp's ranks unchanged: each rank runs ``fn(local_rank, *args)`` once, the function's
``init_process_group`` joins nbddp's group, and everything nbddp gives a run holds (nbddp/rank_side/spawn.py).

Real ranks (``nbddp run --cpu --nproc 2``, gloo), real kernels for ``%%ddp_train``; AIToolbox's
``TrainLoop.fit(gpu_mode='ddp')`` when AIToolbox is installed (``.ci/run`` installs it without the pins that
would replace torch).
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import torch

from nbddp.engines import processes_asked
from nbddp.contracts.errors import NbddpError
from nbddp.notebook.cells import ExportedCell
from nbddp.notebook.reader import Cell
from nbddp.engines import returned
from nbddp.rank_side.spawn import check_rank
from tests.conftest import code, write_notebook
from tests.extras import need

#: PyTorch's tutorial (``intermediate/ddp_tutorial``): its helpers as it writes them, hard-coded port and all;
#: the model a notebook variable, and the data fixed (the tutorial draws it at random) so that the weights can
#: be compared with one process's.
TUTORIAL = '''#| ddp
import os
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = '12355'

    # initialize the process group
    dist.init_process_group("{backend}", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


torch.manual_seed(0)
model = ToyModel()
inputs, labels = torch.randn(40, 10), torch.randn(40, 5)


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {{rank}}.")
    setup(rank, world_size)

    # create model and move it to GPU with id rank (the CPU, on CPU ranks)
    device = rank if torch.cuda.is_available() else "cpu"
    ddp_model = DDP(model.to(device), device_ids=[rank] if torch.cuda.is_available() else None)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    share = len(inputs) // world_size
    for step in range(5):
        optimizer.zero_grad()
        outputs = ddp_model(inputs[rank * share:(rank + 1) * share].to(device))
        labels_ = labels[rank * share:(rank + 1) * share].to(device)
        loss_fn(outputs, labels_).backward()
        optimizer.step()

    cleanup()
    print(f"Finished running basic DDP example on rank {{rank}}.")


def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn,
             args=(world_size,),
             nprocs=world_size,
             join=True)'''
LAUNCH = "#| ddp-train\nworld_size = 2\nrun_demo(demo_basic, world_size)"
EVALUATE = "print('kernel sum', round(float(model.net1.weight.detach().sum()), 6))"


def reference() -> dict[str, torch.Tensor]:
    """The tutorial's training in one process, with the whole batch (what DDP's averaged gradients equal)."""
    namespace: dict = {}
    exec(TUTORIAL.format(backend="gloo").replace("#| ddp\n", ""), namespace)
    model, inputs, labels = namespace["model"], namespace["inputs"], namespace["labels"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), labels).backward()
        optimizer.step()
    return model.state_dict()


def only_run_dir(folder: Path) -> Path:
    (run_dir,) = (folder / "runs").iterdir()
    return run_dir


# ---------------------------------------------------------------- the rules (no processes)


def cells(*sources: str, role: str = "ddp-train") -> list[ExportedCell]:
    return [ExportedCell(Cell(n, "code", s), role, s) for n, s in enumerate(sources, start=1)]


@pytest.mark.parametrize("call, asked", [
    ("mp.spawn(main, args=(2,), nprocs=3, join=True)", 3), ("mp.spawn(main, (2,), 4)", 4),
    ("torch.multiprocessing.spawn(main, nprocs=5)", 5), ("start_processes(main, (), 6)", 6),
    ("mp.spawn(main, args=(n,), nprocs=n)", None), ("pexpect.spawn('ls', [], 30)", None)])
def test_a_literal_nprocs_is_the_runs_process_count(call, asked):
    assert processes_asked(cells(call), "torch") == asked


def test_an_unmarked_notebook_trains_the_cell_that_spawns_its_ranks():
    from nbddp.engines import read_launches

    setup = TUTORIAL.format(backend="gloo").replace("#| ddp\n", "")
    assert read_launches([setup, "print(model)", "run_demo(demo_basic, 2)"]).found == [(2, "run_demo → mp.spawn")]
    assert read_launches(["import torch.multiprocessing as mp", "mp.spawn(f, nprocs=2)"]).found == [(1, "mp.spawn")]
    assert read_launches(["import pexpect", "pexpect.spawn('ls')"]).found == []


def test_the_codes_rank_and_world_size_must_name_this_rank():
    check_rank(-1, -1, 3, 4, 1, 2)  # left out
    check_rank(1, 2, 1, 2, 1, 2)  # one node: the spawn index is the global rank
    check_rank(1, 2, 3, 4, 1, 2)  # several nodes: the tutorial's values describe this node (said)
    check_rank(3, 4, 3, 4, 1, 2)  # AIToolbox: node_rank * num_gpus + gpu, of num_nodes * num_gpus
    for rank, size in ((0, 2), (1, 4), (3, 2), (1, 0)):
        with pytest.raises(NbddpError, match=r"this process is rank 1 of 2 \(local rank 1 of 2"):
            check_rank(rank, size, 1, 2, 1, 2)


def test_the_default_model_no_cell_defines_returns_nothing_and_says_why():
    assert returned(cells("model = 1"), ("model",), "torch") == (("model",), "")
    nothing = returned(cells("def main(rank):\n    model = 1"), ("model",), "torch")
    assert nothing == ((), "nothing to return: no cell defines model (the training function keeps its own)")
    assert returned(cells("x = 1"), ("net",), "torch") == (("net",), "")  # asked by name: a NameError if missing


# ---------------------------------------------------------------- real ranks


@pytest.mark.slow
def test_the_tutorials_notebook_runs_as_ddp_and_gives_one_process_weights(tmp_path, cli_run):
    """As the tutorial writes it: its port taken (the code's meeting place is never used), its nccl on CPU ranks."""
    write_notebook(tmp_path / "tutorial.ipynb", [code(TUTORIAL.format(backend="nccl")), code(LAUNCH),
                                                 code(EVALUATE)])
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 12355))
        taken.listen()
        run = cli_run(["run", "tutorial.ipynb", "--cpu", "--nproc", "2"], tmp_path)
        assert run.wait() == 0, run.output
    out = run.output
    for rank in (0, 1):
        assert f"[rank {rank}] Running basic DDP example on rank {rank}." in out
        assert f"[rank {rank}] Finished running basic DDP example on rank {rank}." in out
    assert out.count("mp.spawn: demo_basic(local_rank, ...) runs once in each of the 2 ranks nbddp started") == 1
    assert out.count("joins nbddp's process group (rank 0 of 2)") == 1 and "MASTER_ADDR/MASTER_PORT ignored" in out
    assert "init_process_group('nccl'): these ranks run on the CPU, so the group is gloo" in out
    trained = torch.load(only_run_dir(tmp_path) / "weights.pt", weights_only=True)["returns"]["model"]
    for key, value in reference().items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6)
    assert f"kernel sum {round(float(trained['net1.weight'].sum()), 6)}" in out  # back in the kernel


@pytest.mark.slow
def test_a_failing_function_is_named_in_the_cell_that_defines_it_and_an_own_model_stays_its_own(tmp_path, cli_run):
    failing = TUTORIAL.format(backend="gloo").replace(
        "    for step in range(5):", "    if rank == 1:\n        raise ValueError('bad shard')\n    for step in range(5):")
    line = failing.split("\n").index("        raise ValueError('bad shard')") + 1
    write_notebook(tmp_path / "bad.ipynb", [code("print('hello')"), code(failing), code(LAUNCH)])
    run = cli_run(["run", "bad.ipynb", "--cpu", "--nproc", "2"], tmp_path)
    assert run.wait() == 1
    assert "rank 1 raised ValueError: bad shard" in run.output and f"bad.ipynb, cell 2, line {line}" in run.output

    own = TUTORIAL.format(backend="gloo").replace("model = ToyModel()\n", "").replace(
        "    ddp_model = DDP(model.to(device)", "    model = ToyModel()\n    ddp_model = DDP(model.to(device)").replace(
        "    cleanup()\n", "    if rank == 0:\n        torch.save(model.state_dict(), 'own.pt')\n    cleanup()\n")
    write_notebook(tmp_path / "own.ipynb", [code(own), code(LAUNCH)])
    run = cli_run(["run", "own.ipynb", "--cpu", "--nproc", "2"], tmp_path)
    assert run.wait() == 0, run.output
    assert "nothing to return: no cell defines model (the training function keeps its own)" in run.output
    assert set(torch.load(tmp_path / "own.pt", weights_only=True)) == set(reference())  # it saved what it saves
    result = json.loads(next((tmp_path / "runs").glob("own-*/result.json")).read_text())
    assert result["status"] == "succeeded"


@pytest.mark.slow
def test_ddp_train_runs_the_tutorial_on_warm_ranks(tmp_path):
    from tests.test_magic import ProtocolKernel
    from tests.test_warm import pids

    kernel = ProtocolKernel(tmp_path)
    try:
        kernel.execute("%load_ext nbddp")
        kernel.execute(TUTORIAL.format(backend="gloo"), "setup")
        first = kernel.execute("%%ddp_train --cpu --nproc 2\n" + LAUNCH.split("\n", 1)[1], "train")
        assert "Finished running basic DDP example on rank 1." in first and "succeeded" in first, first
        trained = weight_of(kernel)
        again = kernel.execute("%%ddp_train --cpu --nproc 2\n" + LAUNCH.split("\n", 1)[1], "train")
        assert "on a warm rank (its run 2)" in again and pids(again) == pids(first), again
        assert weight_of(kernel) == trained  # the same ranks, a fresh run's weights (the port and group restored)
    finally:
        kernel.close()


def weight_of(kernel) -> str:
    return kernel.execute("print(repr(model.net2.bias.detach().tolist()))").strip()


AITOOLBOX = '''#| ddp
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop


class Net(TTModel):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x)

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        return criterion(self(x.to(device)), y.to(device))

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x.to(device)).cpu(), y, {}


torch.manual_seed(0)
model = Net()
X = torch.randn(64, 4)
loader = DataLoader(TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
train_loop = TrainLoop(model, loader, None, None, optimizer, nn.MSELoss(), gpu_mode='ddp')'''


@pytest.mark.beside  # long (AIToolbox's imports on each rank), asserts no timing: evens out .ci/run's lanes
@pytest.mark.slow
def test_aitoolboxs_ddp_train_loop_runs_on_nbddps_ranks(tmp_path, cli_run):
    """AIToolbox's ``gpu_mode='ddp'`` sets its own MASTER_PORT 8888 and spawns ``num_nodes * num_gpus`` processes
    (on the CPU: ``num_gpus=2, on_gpu=False, backend='gloo'``): each of nbddp's ranks runs its ``_spawn_fit``."""
    need("aitoolbox.torchtrain.train_loop", reason="AIToolbox (.ci/run installs it)")
    train = ("#| ddp-train\ntrain_loop.fit(num_epochs=3, num_gpus=2, on_gpu=False, backend='gloo')\n"
             "print('rank weight', round(float(model.fc.weight.detach().sum()), 6), flush=True)")
    write_notebook(tmp_path / "aitb.ipynb", [code(AITOOLBOX), code(train),
                                             code("print('kernel weight', round(float(model.fc.weight.sum()), 6))")])
    run = cli_run(["run", "aitb.ipynb", "--cpu", "--nproc", "2"], tmp_path)
    assert run.wait() == 0, run.output
    sums = re.findall(r"\[rank (\d)\] rank weight (\S+)", run.output)
    assert sorted(sums)[0][1] == sorted(sums)[1][1] and len(sums) == 2, run.output  # DDP kept them in step
    assert f"kernel weight {sums[0][1]}" in run.output  # rank 0's trained model, back in the kernel
    torch.manual_seed(0)
    assert float(sums[0][1]) != round(float(torch.nn.Linear(4, 1).weight.detach().sum()), 6)  # it trained


@pytest.mark.slow
def test_the_bundled_tutorial_example_trains_and_evaluates_on_the_cpu(tmp_path, cli_run):
    import shutil

    shutil.copy(Path(__file__).resolve().parents[1] / "notebooks" / "ddp_tutorial.ipynb", tmp_path)
    run = cli_run(["run", "ddp_tutorial.ipynb", "-p", "epochs", "4"], tmp_path)  # every GPU, or 2 CPU processes
    assert run.wait() == 0, run.output
    assert "[nbddp] loaded the trained model on the CPU" in run.output
    assert float(re.search(r"test accuracy: ([\d.]+)", run.output).group(1)) > 0.85
