"""Catalyst notebooks as Catalyst's DDP tutorial and Sapsan write them: no cell marked, DDP asked for in the call
(``runner.train(..., ddp=True)``, an engine, a runner whose ``get_engine`` returns one), or inside a library that
wraps Catalyst (pointed at with ``--train-cell N``); and the catalyst engine's script refusing torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nbddp.contracts.errors import NotebookError, UsageError
from nbddp.notebook.reader import read_notebook
from nbddp.notebook.script import ExportOptions, generate
from nbddp.plan.options import LaunchOptions
from tests.conftest import code, md, write_notebook
from tests.test_slurm import only_run_dir

SETUP = (
    "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\nfrom catalyst import dl\n"
    "torch.manual_seed(0)\n"
    "X = torch.randn(64, 4)\ny = (X[:, 0] > 0).long()\n"
    "model = torch.nn.Linear(4, 2)\n"
    "loaders = {'train': DataLoader(TensorDataset(X, y), batch_size=8)}\n"
    "criterion = torch.nn.CrossEntropyLoss()\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)"
)
TRAIN = ("runner.train(model=model, criterion=criterion, optimizer=optimizer, loaders=loaders, num_epochs=2, "
         "verbose=False{asks})")
RUNNER = "runner = dl.SupervisedRunner()"
CUSTOM_RUNNER = ("class DDPRunner(dl.SupervisedRunner):\n    def get_engine(self):\n"
                 "        return dl.DistributedDataParallelEngine()\n\nrunner = DDPRunner()")
EVALUATE = "print('first weight', round(float(model.weight[0, 0]), 6))"

#: A stand-in for Sapsan: a library wrapping Catalyst, whose config carries ``ddp=True`` and whose estimator calls
#: ``runner.train(..., ddp=config.ddp)`` inside its own ``train()``: nothing nbddp can read from the notebook.
WRAPPER = '''
from catalyst import dl
import torch


class Config:
    def __init__(self, epochs=2, ddp=False):
        self.epochs, self.ddp = epochs, ddp


class Estimator:
    def __init__(self, config, model, loaders):
        self.config, self.model, self.loaders = config, model, loaders

    def train(self):
        runner = dl.SupervisedRunner()
        runner.train(model=self.model, criterion=torch.nn.CrossEntropyLoss(),
                     optimizer=torch.optim.SGD(self.model.parameters(), lr=0.1), loaders=self.loaders,
                     num_epochs=self.config.epochs, verbose=False, ddp=self.config.ddp)
        return runner.model
'''


def _unmarked(tmp_path: Path, *train_cells: str, name: str = "c.ipynb") -> Path:
    return write_notebook(tmp_path / name, [md("# Catalyst, as its tutorial writes it"), code(SETUP), code(RUNNER),
                                            *(code(cell) for cell in train_cells), code(EVALUATE)])


def _export(path: Path, **options: object) -> str:
    return generate(read_notebook(path), ExportOptions(**options)).text


@pytest.mark.parametrize("asks, call", [
    (", ddp=True", "runner.train(ddp=True)"),
    (", engine=dl.DistributedDataParallelEngine()", "runner.train(engine=DistributedDataParallelEngine)"),
])
def test_a_train_call_that_asks_for_ddp_is_the_training_cell_of_an_unmarked_notebook(tmp_path, asks, call):
    script = generate(read_notebook(_unmarked(tmp_path, TRAIN.format(asks=asks))))
    assert script.engine == "catalyst"
    assert script.note == f"no cell is marked: cell 4 ({call}) is the training cell, cells 2, 3 its setup; cell 5 runs " \
                          "only in the kernel"
    assert "_nbddp.use_ddp(returns=['model'])" in script.text and "print('first weight'" not in script.text


def test_an_engine_held_in_a_variable_and_a_runner_whose_get_engine_returns_one_ask_for_ddp_too(tmp_path):
    held = write_notebook(tmp_path / "held.ipynb", [code(SETUP), code(RUNNER + "\nengine = dl.DistributedDataParallelEngine()"),
                                                    code(TRAIN.format(asks=", engine=engine"))])
    assert generate(read_notebook(held)).note.startswith(
        "no cell is marked: cell 3 (runner.train(engine=DistributedDataParallelEngine)) is the training cell")
    custom = write_notebook(tmp_path / "custom.ipynb", [code(SETUP), code(CUSTOM_RUNNER), code(TRAIN.format(asks=""))])
    assert generate(read_notebook(custom)).note.startswith(
        "no cell is marked: cell 3 (runner.train (DDPRunner.get_engine: DistributedDataParallelEngine)) is the training")


def test_a_train_call_that_asks_for_no_ddp_is_no_launch_and_the_refusal_says_how_to_ask(tmp_path):
    path = _unmarked(tmp_path, TRAIN.format(asks=""))
    with pytest.raises(NotebookError) as refused:
        generate(read_notebook(path))
    said = str(refused.value)
    assert "no training cell" in said and "a Catalyst runner's .train(..., ddp=True)" in said
    assert "A Catalyst runner's .train(...) here asks for no DDP: pass ddp=True to it" in said
    assert "Accelerate's notebook_launcher(...)" in said  # every record's launch, from the records


def test_several_cells_asking_for_ddp_are_refused_naming_each_and_how_to_name_the_one_meant(tmp_path):
    path = _unmarked(tmp_path, TRAIN.format(asks=", ddp=True"), TRAIN.format(asks=""),
                     TRAIN.format(asks=", ddp=True, num_epochs=3").replace("num_epochs=2, ", ""))
    with pytest.raises(NotebookError) as refused:
        generate(read_notebook(path))
    said = str(refused.value)
    assert "\n" not in said.split(" see: ")[0]  # one line
    assert ("2 cells launch a training: cell 4 (runner.train(ddp=True)), cell 6 (runner.train(ddp=True)); nbddp "
            "can't tell which is meant. Name it with --train-cell N") in said
    script = generate(read_notebook(path), ExportOptions(train_cell=6))  # named: chosen, with its setup (the earlier
    assert script.note == ("no cell is marked: cell 6 (--train-cell 6) is the training cell, cells 2-5 its setup; "  # train
                           "cell 7 runs only in the kernel")  # calls change the runner it trains, as in the kernel)


def test_train_cell_is_refused_with_marks_on_a_cell_that_isnt_code_and_below_1(tmp_path):
    marked = write_notebook(tmp_path / "m.ipynb", [code("#| ddp\n" + SETUP), code("#| ddp-train\n" + RUNNER)])
    with pytest.raises(NotebookError, match=r"--train-cell 2 names the training cell of a notebook with no cell "
                                            r"marked, but cells 1, 2 are marked"):
        _export(marked, train_cell=2)
    with pytest.raises(NotebookError, match=r"--train-cell 1: cell 1 is not a code cell \(the code cells: 2-5\)"):
        _export(_unmarked(tmp_path, TRAIN.format(asks=", ddp=True")), train_cell=1)
    with pytest.raises(UsageError, match="--train-cell 0: cells are numbered from 1"):
        LaunchOptions(train_cell=0)


def test_a_library_wrapping_catalyst_is_pointed_at_with_train_cell_and_its_engine(tmp_path):
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    path = write_notebook(tmp_path / "w.ipynb", [code(SETUP), code("from wrapper import Config, Estimator"),
                                                 code("estimator = Estimator(Config(epochs=2, ddp=True), model, loaders)"),
                                                 code("model = estimator.train()"), code(EVALUATE)])
    with pytest.raises(NotebookError, match="no training cell"):  # nothing nbddp reads launches it
        _export(path)
    script = generate(read_notebook(path), ExportOptions(engine="catalyst", train_cell=4))
    assert script.engine == "catalyst" and script.training == (4,)
    assert script.note == "no cell is marked: cell 4 (--train-cell 4) is the training cell, cells 1-3 its setup; " \
                          "cell 5 runs only in the kernel"


def _first_weight(folder: Path) -> float:
    import torch

    weights = torch.load(only_run_dir(folder) / "weights.pt", weights_only=True)["returns"]["model"]
    return round(float(weights["weight"][0, 0]), 6)


@pytest.mark.slow
@pytest.mark.beside  # three Catalyst runs that assert no timing
def test_unmarked_and_wrapped_catalyst_notebooks_train_on_two_ranks_as_the_marked_one(tmp_path, cli_run):
    """The same training three ways: marked (the reference), unmarked with a runner whose ``get_engine`` returns
    Catalyst's DDP engine (nbddp's engine is what it returns on the ranks), and through a wrapper library pointed
    at with ``--train-cell``: the same weights come back to each kernel, which evaluates with them."""
    runs = {}
    for name, cells, options in (
            ("marked", [code("#| ddp\n" + SETUP), code("#| ddp\n" + RUNNER),
                        code("#| ddp-train\n" + TRAIN.format(asks=""))], []),
            ("custom", [code(SETUP), code(CUSTOM_RUNNER), code(TRAIN.format(asks=""))], []),
            ("wrapped", [code(SETUP), code("from wrapper import Config, Estimator"),
                         code("estimator = Estimator(Config(epochs=2, ddp=True), model, loaders)"),
                         code("model = estimator.train()")], ["--engine", "catalyst", "--train-cell", "4"])):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "wrapper.py").write_text(WRAPPER)
        write_notebook(folder / "c.ipynb", [*cells, code(EVALUATE)])
        runs[name] = cli_run(["run", "c.ipynb", "--cpu", "--nproc", "2", *options], folder)  # (the three at once)
    for run in runs.values():
        assert run.wait() == 0, run.output
        assert "catalyst engine, 2 CPU processes (gloo)" in run.output
    assert "[rank 1]" in runs["custom"].output and "[rank 1]" in runs["wrapped"].output
    reference = _first_weight(tmp_path / "marked")
    for name, run in runs.items():
        assert _first_weight(tmp_path / name) == reference, name
        assert f"first weight {reference}" in run.output, name  # the kernel evaluated with the ranks' weights
        assert not run.leftovers()


@pytest.mark.slow
@pytest.mark.beside  # asserts no timing
def test_the_catalyst_engines_script_refuses_torchrun_in_one_line(tmp_path):
    """torchrun would start N processes that each spawn N ranks of Catalyst's: refused at once, saying how."""
    path = _unmarked(tmp_path, TRAIN.format(asks=", ddp=True"))
    (tmp_path / "train.py").write_text(_export(path))
    own = tmp_path / "tmp"  # (torchrun leaves its torchelastic_* folder behind when its workers fail)
    own.mkdir()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180, env={**os.environ, "TMPDIR": str(own)})
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if line.startswith("nbddp: ")]
    assert said and said[0] == (
        "nbddp: this script runs on Catalyst's DDP engine, which starts one rank per device itself: under torchrun "
        "each of its processes would start as many. Run it with python (NBDDP_NPROC=N python train.py; nbddp run "
        "starts it so).")
    assert "Epoch" not in done.stdout + done.stderr and not (tmp_path / "logs").exists()  # nothing trained


def test_every_door_asks_the_same_choice_papermills_engine_and_a_batch_too(tmp_path):
    """papermill's engine asks which cells train before it runs anything, a batch which engine its runs use (warm
    ranks can't serve Catalyst's): both get the unmarked choice, ``--train-cell`` included."""
    from nbddp.notebook.cells import training_cells
    from nbddp.notebook.script import engine_of

    notebook = read_notebook(_unmarked(tmp_path, TRAIN.format(asks=", ddp=True")))
    assert training_cells(notebook) == (4,) and engine_of(notebook) == "catalyst"
    wrapped = read_notebook(_unmarked(tmp_path, "model = train_somehow(model)", name="w.ipynb"))
    assert training_cells(wrapped) == () and training_cells(wrapped, train_cell=4) == (4,)
    assert engine_of(wrapped, "catalyst", train_cell=4) == "catalyst"


def test_train_cell_names_a_cell_that_trains_not_the_parameters_or_one_past_the_end(tmp_path):
    path = write_notebook(tmp_path / "p.ipynb", [code("lr = 0.1", "parameters"), code(SETUP), code(RUNNER),
                                                 code(TRAIN.format(asks=""))])
    with pytest.raises(NotebookError, match="--train-cell 1: cell 1 is the notebook's parameters cell, which sets the "
                                            "run's values: name the cell that trains"):
        _export(path, train_cell=1)
    with pytest.raises(NotebookError, match=r"--train-cell 9: the notebook has 4 cells \(the code cells: 1-4\)"):
        _export(path, train_cell=9)
    assert "cell 4 (--train-cell 4) is the training cell, cells 1-3 its setup" in generate(
        read_notebook(path), ExportOptions(train_cell=4)).note
