"""Engines are registered records (nbddp.engines.BUILTIN, as launchers are): every per-engine fact is read from
an engine's record, so an engine added by its own module and one registry line is detected, writes its code and
is described in --engine's help, with nothing else restating it. A toy engine, defined here, stands for a new one."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

import nbddp.engines as engines
from nbddp.contracts.role_names import SETUP, TRAIN
from nbddp.engines.engine import CellFacts, CodeRequest, Engine, EngineCode
from nbddp.plan.options import options_table


@dataclass(frozen=True)
class Cell:
    role: str
    code: str


def _toy_code(request: CodeRequest) -> EngineCode:
    return EngineCode(imports=("import toy",), train_prologue=(), train_epilogue=(f"toy.hand_back({request.returns!r})",),
                      launch_hint=f"toy-run {request.script_name}")


def _toy_trains(facts: CellFacts) -> bool:
    return "toy" in facts.imported and "go" in facts.trained


TOY = Engine("toy", _toy_code, packages=("toy",), trains_with=_toy_trains, detected_by="toy.go()",
             spawns_its_own_ranks=True, shard_instead="the toy shards nothing")


def test_every_registered_engine_is_one_record_and_the_doors_read_them():
    assert engines.ENGINES == tuple(engines.BUILTIN) and engines.ENGINES[0] == "torch"
    for name in engines.ENGINES:
        assert engines.engine(name).name == name
    assert engines.engine_help() == (
        "DDP engine (default: from the training cells: catalyst for runner.train(loaders=...), accelerate for "
        "notebook_launcher/Accelerator, lightning for Trainer.fit, transformers for a Hugging Face Trainer's "
        "train(), else torch)")
    assert engines.engine_help() in options_table()  # --engine's help, every door's and the README's
    assert [e.name for e in engines.engines() if e.spawns_its_own_ranks] == ["catalyst"]
    assert [e.name for e in engines.engines() if e.shard_instead is None] == ["torch"]
    assert [e.name for e in engines.engines() if e.library] == ["accelerate", "lightning", "transformers"]


def test_an_engine_registered_by_one_line_is_detected_writes_its_code_and_is_described(monkeypatch):
    monkeypatch.setitem(engines.BUILTIN, "toy", f"{__name__}:TOY")
    monkeypatch.setattr(engines, "_loaded", {})
    cells = [Cell(SETUP, "import toy\nmodel = toy.Model()"), Cell(TRAIN, "model.go(epochs=2)")]
    assert engines.detect_engine(cells) == "toy"
    assert engines.detect_engine([Cell(SETUP, "import toy"), Cell(TRAIN, "print(1)")]) == "torch"  # not its call
    code = engines.plan_engine(cells, "toy", ("model",), "train.py").code
    assert code.imports == ("import toy",) and code.launch_hint == "toy-run train.py"
    assert engines.spawns_its_own_ranks("toy") and not engines.shards("toy")
    assert "--shard needs the torch engine: the toy shards nothing." in engines.shard_refusal("toy")
    assert "toy for toy.go()" in engines.engine_help()
    with pytest.raises(KeyError):
        engines.engine("no-such-engine")


SPIED_TORCH = '''
from dataclasses import replace
from nbddp.engines.torch import ENGINE as TORCH

def _code(request):
    code = TORCH.code(request)
    return replace(code, notes=(*code.notes, "the torch engine of nbddp-spy-engine"))

def _launches(call):
    return "my_launch" if call.name == "my_launch" else TORCH.launches(call)

ENGINE = replace(TORCH, code=_code, launches=_launches)
'''


def test_an_installed_package_replaces_a_builtin_engine_through_its_entry_point(tmp_path):
    """A record registered under ``nbddp.engines`` (a real distribution's entry point) replaces the built-in one of
    that name: its code is written, and its own launch call picks an unmarked notebook's training cell."""
    import subprocess
    import sys

    from tests.conftest import code, write_notebook
    from tests.plugin_site import plugin_environment

    env = plugin_environment(tmp_path / "site", "nbddp_spy_engine", SPIED_TORCH,
                             {"nbddp.engines": {"torch": "nbddp_spy_engine:ENGINE"}})
    write_notebook(tmp_path / "fit.ipynb", [code("import torch\nmodel = torch.nn.Linear(2, 1)"),
                                            code("def my_launch():\n    pass"), code("my_launch()")])
    done = subprocess.run([sys.executable, "-m", "nbddp", "export", "fit.ipynb", "-o", "-"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "# the torch engine of nbddp-spy-engine" in done.stdout
    assert "No cell is marked: cell 3 (my_launch) is the training cell, cells 1, 2 its setup" in done.stdout
    bare = subprocess.run([sys.executable, "-m", "nbddp", "export", "fit.ipynb", "-o", "-"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and "no training cell" in bare.stderr  # without the package: nothing launches


TOY_TORCH = replace(engines.engine("torch"), code=_toy_code)


def test_register_replaces_a_builtin_record_in_this_process_and_refuses_a_name_none_has(monkeypatch):
    """``register()`` does in one process what an entry point does in every one (a plugin tried from a notebook)."""
    import nbddp.launchers as launchers
    from nbddp.contracts.errors import UsageError
    from nbddp.contracts.plugins import registered
    from nbddp.launchers.torchrun import Torchrun

    monkeypatch.setattr(engines, "_loaded", {})
    monkeypatch.setitem(registered(engines.ENTRY_POINTS), "torch", engines.BUILTIN["torch"])  # (put back after)
    engines.register("torch", f"{__name__}:TOY_TORCH")
    assert engines.engine("torch") is TOY_TORCH
    cells = [Cell(SETUP, "import torch\nmodel = torch.nn.Linear(1, 1)"), Cell(TRAIN, "print(model)")]
    assert engines.plan_engine(cells, None, ("model",), "train.py").code.launch_hint == "toy-run train.py"
    monkeypatch.setitem(registered(launchers.ENTRY_POINTS), "direct", launchers.BUILTIN["direct"])
    launchers.register("direct", "nbddp.launchers.torchrun:Torchrun")
    assert launchers.launcher_class("direct") is Torchrun
    with pytest.raises(UsageError, match="no engine is named 'jax': register"):
        engines.register("jax", "x:y")
    with pytest.raises(UsageError, match="no launcher is named 'mpirun': register"):
        launchers.register("mpirun", "x:y")
