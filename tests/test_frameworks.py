"""Notebooks written for Accelerate, Lightning and the Hugging Face Trainer run unchanged as DDP jobs.

The slow tests run the real libraries in real ranks (torchrun, 2 gloo CPU processes) through ``nbddp
run`` and ``%%ddp_train`` in a real kernel, and compare the weights with the same training in one plain
Python process (:mod:`tests.framework_notebooks`); the rest test detection and the adaptations' policies
in this process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook

from nbddp.contracts.devices import Devices
from nbddp.engines import detect_engine, processes_asked, shard_refusal, read_launches
from nbddp.contracts.errors import DeviceError, NbddpError, UsageError
from nbddp.launchers import devices_for
from nbddp.notebook.cells import select_cells
from nbddp.notebook.reader import read_notebook
from nbddp.notebook.script import ExportOptions, generate
from nbddp.plan.options import LaunchOptions
from tests.conftest import code, wait_until, write_notebook
from tests.extras import need
from tests.framework_notebooks import NOTEBOOKS, weights_sum

ENGINES = sorted(NOTEBOOKS)
#: What rank 0 says once the library is adapted, before its training starts.
ADAPTED = {"accelerate": "[rank 0] [nbddp] notebook_launcher: training_loop() runs in each of the 2 ranks torchrun started",
           "lightning": "[rank 0] [nbddp] Trainer(strategy='ddp_notebook', devices=2) runs as strategy='ddp' on 2 "
                        "process(es)",
           "transformers": "[rank 0] [nbddp] Trainer: trains on 2 process(es) started by torchrun (distributed, cpu)"}


def exported(tmp_path, cells, **options):
    path = write_notebook(tmp_path / "nb.ipynb", cells)
    return generate(read_notebook(path), ExportOptions(**options))


# ---------------------------------------------------------------- in this process


@pytest.mark.parametrize("engine", ENGINES)
def test_each_librarys_notebook_is_detected_and_its_script_adapts_the_library(tmp_path, engine):
    script = exported(tmp_path, NOTEBOOKS[engine].cells())
    assert script.engine == engine
    package = {"lightning": "lightning"}.get(engine, engine)
    assert f"_nbddp.start(framework={engine!r}, packages=({package!r},))" in script.text
    assert "torch.distributed.run --standalone --nproc-per-node=2" in script.text  # launched by torchrun
    assert script.processes == {"accelerate": 2, "lightning": 2, "transformers": None}[engine]
    compile(script.text, "train.py", "exec")


def test_detection_needs_the_import_and_the_call_and_engine_overrides_it(tmp_path):
    def engine_of(*sources):
        path = write_notebook(tmp_path / "d.ipynb", [code(s) for s in sources])
        return detect_engine(select_cells(read_notebook(path)))

    assert engine_of("#| ddp\nimport accelerate", "#| ddp-train\nprint(1)") == "torch"
    assert engine_of("#| ddp\nfrom accelerate import Accelerator", "#| ddp-train\nacc = Accelerator()") == "accelerate"
    assert engine_of("#| ddp\nfrom accelerate import Accelerator\nacc = Accelerator()",  # built where the ranks need it
                     "#| ddp-train\nacc.backward(loss)") == "accelerate"
    assert engine_of("#| ddp\nimport pytorch_lightning as pl", "#| ddp-train\npl.Trainer().fit(m)") == "lightning"
    assert engine_of("#| ddp\nimport lightning as L", "#| ddp-train\nm.fit(x)") == "torch"  # (no Trainer: sklearn's fit)
    assert engine_of("#| ddp\nfrom accelerate import Accelerator\ndef loop():\n    Accelerator()",  # a kernel's
                     "#| ddp\nimport lightning as L", "#| ddp-train\nL.Trainer().fit(m)") == "lightning"  # other cells
    assert engine_of("#| ddp\nfrom transformers import AutoModel, Seq2SeqTrainer\nt = Seq2SeqTrainer()",
                     "#| ddp-train\nt.train()") == "transformers"
    assert engine_of("#| ddp\nfrom transformers import AutoModel\nimport nbddp",  # a raw loop over a HF model
                     "#| ddp-train\nmodel = nbddp.prepare(AutoModel())\nmodel.train()") == "torch"
    script = exported(tmp_path, NOTEBOOKS["lightning"].cells(), engine="torch")
    assert script.engine == "torch" and "framework=" not in script.text


def test_the_cell_that_launches_a_librarys_training_is_found_without_marks():
    assert read_launches(["from accelerate import notebook_launcher\ndef main():\n    notebook_launcher(f)",
                          "notebook_launcher(f, num_processes=2)"]).found == [(1, "notebook_launcher")]  # not a def body
    assert read_launches(["import lightning as L\nfrom sklearn.linear_model import Ridge\nRidge().fit(X, y)",
                          "model.fit(X, y)", "trainer = L.Trainer(devices=2)", None,  # (a cell that isn't Python)
                          "trainer.fit(model, loader)"]).found == [(4, "trainer.fit")]
    assert read_launches(["import pytorch_lightning as pl", "pl.Trainer().fit(m)"]).found == [(1, "Trainer(...).fit")]
    assert read_launches(["from transformers import Seq2SeqTrainer\nmodel.train()",
                          "t = Seq2SeqTrainer(model=model)\nt.train()"]).found == [(1, "t.train")]
    assert read_launches(["import torch\nmodel.train()", "trainer = Trainer()\ntrainer.fit(m)"]).found == []  # no library
    assert read_launches(["from accelerate import Accelerator\nacc = Accelerator()"]).found == []  # a loop, not a launch


def test_lightning_packages_are_the_ones_the_notebook_imports(tmp_path):
    cells = [code("#| ddp\nimport pytorch_lightning as pl\nmodel = 1"), code("#| ddp-train\npl.Trainer(devices=3).fit(model)")]
    script = exported(tmp_path, cells)
    assert "packages=('pytorch_lightning',)" in script.text and script.processes == 3


def test_the_notebooks_process_count_is_the_runs_unless_a_launch_option_or_fewer_gpus_say_otherwise():
    asked = devices_for(LaunchOptions(), visible=0, asked=3)
    assert asked == Devices("cpu", 3, asked.note) and "as the notebook asks" in asked.note
    assert devices_for(LaunchOptions(nproc=2), visible=0, asked=3).nproc == 2
    on_cpu = devices_for(LaunchOptions(cpu=True), visible=4, asked=3)
    assert (on_cpu.kind, on_cpu.nproc) == ("cpu", 3)
    assert devices_for(LaunchOptions(), visible=4, asked=2) == Devices("cuda", 2, "2 GPUs, as the notebook asks "
                                                                       "(--gpus / --nproc choose otherwise).")
    fewer = devices_for(LaunchOptions(), visible=1, asked=2)  # (GPU counts simulated: see tests/test_devices.py)
    assert fewer == Devices("cuda", 1, "the notebook asks for 2 processes and 1 GPU is visible: training on 1 GPU, "
                                       "one process each (--cpu runs 2 CPU processes instead).")
    with pytest.raises(DeviceError, match="--gpus 2 asks for more GPUs than the 1 visible"):
        devices_for(LaunchOptions(gpus="2"), visible=1, asked=2)
    assert processes_asked([], "transformers") is None


@pytest.mark.parametrize("engine", ["accelerate", "lightning", "transformers", "catalyst"])
def test_shard_is_refused_for_a_library_engine_saying_what_shards_there(tmp_path, engine):
    with pytest.raises(UsageError, match="--shard needs the torch engine"):
        LaunchOptions(engine=engine, shard=True)
    assert {"accelerate": "fsdp_plugin", "lightning": "strategy=\"fsdp\"", "transformers": "fsdp=",
            "catalyst": "no FSDP2 engine"}[engine] in shard_refusal(engine)
    if engine in NOTEBOOKS:
        with pytest.raises(UsageError, match="--shard needs the torch engine"):
            exported(tmp_path, NOTEBOOKS[engine].cells(), shard=True)


def test_a_training_function_defined_only_in_an_untagged_cell_is_refused_naming_the_cell(tmp_path):
    from nbddp.contracts.errors import CellError
    from nbddp.contracts.freevars import check_defined

    setup, function = NOTEBOOKS["accelerate"].setup.split("\ndef training_loop", 1)
    cells = [code("#| ddp\n" + setup), code("def training_loop" + function),  # (no directive: the kernel's only)
             code("#| ddp-train\nnotebook_launcher(training_loop, args=(model, 3, 8), num_processes=2)")]
    with pytest.raises(CellError, match=r"nb.ipynb, cell 3, line 2: the training code uses 'training_loop'.*"
                                        r"cells without a tag run only in the kernel"):
        check_defined(exported(tmp_path, cells))


def test_lightnings_forking_strategies_become_torchruns():
    from nbddp.rank_side.frameworks import lightning_strategy

    assert lightning_strategy("ddp_notebook", 2) == "ddp"
    assert lightning_strategy("ddp_fork_find_unused_parameters_true", 2) == "ddp_find_unused_parameters_true"
    assert lightning_strategy("ddp_spawn", 2) == "ddp"
    assert lightning_strategy("auto", 2) == "ddp" and lightning_strategy(None, 1) == "auto"
    assert lightning_strategy("fsdp", 2) == "fsdp" and lightning_strategy("deepspeed_stage_2", 2) == "deepspeed_stage_2"

    class Forking:
        _start_method = "fork"

    assert lightning_strategy(Forking(), 2)._start_method == "popen"


def test_a_lightning_trainer_gets_this_runs_devices_and_says_so(monkeypatch, capsys, as_cpu_rank):
    """A CPU rank's Trainer (``--cpu``, on a machine with GPUs too): the GPU case is in tests/test_gpu.py."""
    from nbddp.rank_side.frameworks import _lightning_kwargs

    for name, value in {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    kwargs = {"strategy": "ddp_notebook", "devices": 8, "accelerator": "gpu", "max_epochs": 3}
    _lightning_kwargs(kwargs)
    assert kwargs == {"strategy": "ddp", "devices": 2, "num_nodes": 2, "accelerator": "cpu", "max_epochs": 3}
    assert ("[nbddp] Trainer(strategy='ddp_notebook', devices=8) runs as strategy='ddp' on 4 process(es) (2 per "
            "node, cpu), started by torchrun") in capsys.readouterr().out
    with pytest.raises(NbddpError, match=r"Trainer\(strategy='fsdp'\) trains on GPUs only .* use strategy='ddp' here"):
        _lightning_kwargs({"strategy": "fsdp"})


def test_on_fewer_gpus_than_the_notebook_asks_each_library_gets_the_runs_count(monkeypatch, capsys):
    """One GPU, a notebook written for 2: the run has 1 rank (see the test above), and in it Accelerate's
    ``notebook_launcher(num_processes=2)`` runs the function once and Lightning's ``devices=2`` becomes 1,
    so neither waits for a second process nor starts one. (Run here in a CPU process: the device is the
    one thing a GPU would change, ``accelerator``.)"""
    need("accelerate")
    from nbddp.rank_side import frameworks

    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    calls = []
    frameworks.notebook_launcher(calls.append, args=("trained",), num_processes=2)
    assert calls == ["trained"]
    out = capsys.readouterr().out
    assert "notebook_launcher(num_processes=2): running on 1 process(es) per node, as the run chose" in out
    assert "runs in each of the 1 ranks torchrun started" in out
    kwargs = {"strategy": "ddp_notebook", "devices": 2, "accelerator": "cpu"}
    frameworks._lightning_kwargs(kwargs)
    assert (kwargs["devices"], kwargs["num_nodes"], kwargs["strategy"]) == (1, 1, "ddp")
    assert "Trainer(strategy='ddp_notebook', devices=2) runs as strategy='ddp' on 1 process(es)" in capsys.readouterr().out


def test_notebook_launcher_runs_the_function_here_and_refuses_what_nbddp_decides(monkeypatch):
    accelerate = need("accelerate")
    from nbddp.rank_side import frameworks

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    seen = []
    frameworks.notebook_launcher(lambda a, b: seen.append((a, b, os.environ["ACCELERATE_MIXED_PRECISION"])),
                                 args=(1, 2), num_processes=1, mixed_precision="BF16", use_port="29501")
    assert seen == [(1, 2, "bf16")] and "ACCELERATE_MIXED_PRECISION" not in os.environ
    with pytest.raises(NbddpError, match=r"notebook_launcher\(num_nodes=2\): .* run with --nnodes 2"):
        frameworks.notebook_launcher(print, num_nodes=2)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # a run on two nodes: left out, num_nodes is the run's
    frameworks.notebook_launcher(seen.append, args=("two nodes",))
    assert seen[-1] == "two nodes"
    with pytest.raises(NbddpError, match=r"notebook_launcher\(max_restarts=3\): .* --max-restarts 3"):
        frameworks.notebook_launcher(print, max_restarts=3)
    with pytest.raises(ValueError, match=r"mixed_precision='fp64'\): choose one of"):
        frameworks.notebook_launcher(print, mixed_precision="fp64")
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_gpus'"):
        frameworks.notebook_launcher(print, num_gpus=2)
    assert accelerate.notebook_launcher is not frameworks.notebook_launcher  # (adapted only in a rank)


def test_import_nbddp_imports_none_of_the_libraries():
    probe = ("import sys, nbddp, nbddp.doors.cli, nbddp.engines.frameworks; "
             "print(sorted(m for m in ('torch', 'accelerate', 'lightning', 'pytorch_lightning', 'transformers', 'ray') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- real ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each library's one-process weights, computed once for the module's tests."""
    computed: dict[str, dict[str, torch.Tensor]] = {}

    def of(engine: str) -> dict[str, torch.Tensor]:
        if engine not in computed:
            computed[engine] = NOTEBOOKS[engine].reference(tmp_path_factory.mktemp(f"reference-{engine}"))
        return computed[engine]

    return of


def kernel_weights(output: str) -> float:
    """The sum of the kernel's model's weights, as its evaluation cell printed it."""
    found = re.search(r"kernel weights (-?[0-9.e+-]+)", output)
    assert found, output
    return float(found.group(1))


def assert_weights(run_dir, expected: dict[str, torch.Tensor], engine: str) -> None:
    weights = torch.load(run_dir / "weights.pt", weights_only=True)["returns"]["model"]
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=f"{engine}: {name}")


@pytest.mark.beside  # long (each library's imports in a kernel and two ranks), asserts no timing: evens out .ci/run's lanes
@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_nbddp_run_trains_the_librarys_notebook_on_two_ranks_with_one_processs_weights(tmp_path, cli_run, engine,
                                                                                      reference):
    write_notebook(tmp_path / "nb.ipynb", NOTEBOOKS[engine].cells())
    run = cli_run(["run", "nb.ipynb", "--cpu"], tmp_path)
    assert run.wait() == 0, run.output
    assert not run.leftovers()
    assert ADAPTED[engine] in run.output, run.output
    if engine == "accelerate":
        assert "on 2 processes, DistributedType.MULTI_CPU" in run.output  # Accelerator saw torchrun's ranks
    [run_dir] = sorted((tmp_path / "runs").iterdir())
    assert_weights(run_dir, reference(engine), engine)
    assert "[cell 3] kernel loss" in run.output  # the kernel evaluated the returned model on the CPU: the trained one
    assert kernel_weights(run.output) == pytest.approx(weights_sum(reference(engine)), abs=2e-3), run.output
    if engine != "accelerate":  # the library's own metrics drive the view
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert records and {"epoch", "epochs", "step"} <= records[-1].keys()
        assert any(k in records[0] for k in ("train_loss", "loss"))


@pytest.mark.beside  # (as above)
@pytest.mark.slow
def test_nbddp_run_trains_an_unmarked_accelerate_notebook_with_the_cells_nbddp_chose(tmp_path, cli_run, reference):
    """No cell marked: the cell calling notebook_launcher trains, cells 1-2 (imports, data, model, loop) are its
    setup, said in one line; the look at the model and the evaluation run only in the kernel."""
    engine = "accelerate"
    write_notebook(tmp_path / "nb.ipynb", NOTEBOOKS[engine].unmarked_cells())
    run = cli_run(["run", "nb.ipynb", "--cpu", "--nproc", "2"], tmp_path)
    assert run.wait() == 0, run.output
    assert not run.leftovers()
    assert ("nbddp: no cell is marked: cell 4 (notebook_launcher) is the training cell, cells 1, 2 its setup; "
            "cells 3, 5 run only in the kernel\n") in run.output
    assert ADAPTED[engine] in run.output and "on 2 processes, DistributedType.MULTI_CPU" in run.output
    [run_dir] = sorted((tmp_path / "runs").iterdir())
    assert_weights(run_dir, reference(engine), engine)  # the weights came back: the same as one process's
    script = (run_dir / "train.py").read_text()
    assert "# %% cell 4 [ddp-train]" in script and "a look at the model" not in script
    assert "[cell 3] a look at the model: 5 parameters" in run.output  # the kernel ran it
    assert kernel_weights(run.output) == pytest.approx(weights_sum(reference(engine)), abs=2e-3), run.output


@pytest.mark.waits  # mostly a timeout or a mid-training signal: runs beside the rest in .ci/run
@pytest.mark.slow
def test_ctrl_c_stops_lightnings_ranks_although_they_catch_sigterm(tmp_path, cli_run):
    """``nbddp run``'s Ctrl-C stops the launcher (SIGTERM, forwarded to the ranks); Lightning's ranks catch
    SIGTERM and would wait for their next step (10 s away here): they must go with torchrun all the same.
    (Ctrl-C in a notebook, the stop button, is tested for every library in the kernel test below.)"""
    engine = "lightning"
    setup, *rest = NOTEBOOKS[engine].cells(slow="10")  # each step 10 s: still training
    setup.source = announcing_steps(setup.source)
    write_notebook(tmp_path / "nb.ipynb", [setup, *rest])
    run = cli_run(["run", "nb.ipynb", "--cpu"], tmp_path)
    run.wait_for(ADAPTED[engine], timeout=120)  # the library's training starts
    wait_until(lambda: in_a_step((tmp_path / "runs").iterdir()), 120,  # (Lightning's SIGTERM handler in place then)
               "both ranks in their first 10 s step (their logs)", every=0.2)
    run.proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert run.wait(timeout=60) == 130, run.output
    assert time.monotonic() - sent < 15 and not run.leftovers()
    [run_dir] = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "result.json").read_text())["status"] == "interrupted"


#: What a slow step says first (:func:`announcing_steps`).
IN_A_STEP = "in a slow step"


def announcing_steps(setup: str) -> str:
    """A library's setup cell whose slow steps (``slow`` > 0) print :data:`IN_A_STEP` before they sleep, on the
    sleep's own line (the cell's line numbers stay): a test that stops the training waits for that, not a time."""
    for sleep in ("time.sleep(slow)", "time.sleep(self.slow)"):
        if setup.count(sleep) == 1:
            slow = sleep.removeprefix("time.sleep(").removesuffix(")")
            return setup.replace(sleep, f"{slow} and print({IN_A_STEP!r}, flush=True); {sleep}")
    raise AssertionError(f"no one slow step in:\n{setup}")


def in_a_step(run_dirs) -> bool:
    """Whether both ranks of one of ``run_dirs`` have said :data:`IN_A_STEP` (their logs: the terminal shows a line
    both ranks print as one, ``[all ranks]``)."""
    def said(log) -> bool:
        return log.exists() and IN_A_STEP in log.read_text(errors="replace")

    return any(all(said(run / "logs" / f"rank-{rank}.log") for rank in (0, 1)) for run in run_dirs)


def _rank_pids(run_dir) -> set[int]:
    return {json.loads(p.read_text())["pid"] for p in (run_dir / "ranks").glob("rank-*.json")}


@pytest.mark.waits  # three 8 s timeouts, three stop buttons 6 s into a 10 s step: runs beside the rest in .ci/run
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_train_runs_each_library_in_a_kernel_whose_cuda_state_would_stop_the_peers(tmp_path, reference):
    """The kernel "has touched CUDA" (simulated on CPU: torch's own bad-fork check says so, as it does
    once a kernel initialised CUDA): Lightning's ddp_notebook refuses to fork from it, as users report
    (Lightning#21389); ``%%ddp_train`` runs the same cells in fresh ranks. For each library, one after
    another on the kernel's warm ranks: the weights of one process come back, a failing rank names the
    cell and line, and ``--timeout`` and the stop button stop the job; nothing is left once the kernel is gone."""
    from nbclient import NotebookClient
    from nbclient.util import run_sync

    cells = [new_code_cell("%load_ext nbddp\nimport torch\ntorch.cuda._is_in_bad_fork = lambda: True")]
    where: dict[str, dict[str, int]] = {}
    for engine in ENGINES:
        notebook = NOTEBOOKS[engine]
        train = notebook.train.format(batch=notebook.batch, fail="False", slow="0")
        where[engine] = {"setup": len(cells), "train": len(cells) + 1}
        cells += [new_code_cell("#| ddp\n" + announcing_steps(notebook.setup)),
                  new_code_cell("%%ddp_train --cpu\n" + train), new_code_cell(notebook.evaluate)]
        if engine == "lightning":  # the peer's own way, from the same kernel
            where[engine]["peer"] = len(cells)
            cells.append(new_code_cell(train.replace("trainer.fit", "try:\n    trainer.fit") +
                                       "\nexcept RuntimeError as exc:\n    print('LIGHTNING REFUSED:', exc)"))
        where[engine]["fail"] = len(cells)
        cells.append(new_code_cell("%%ddp_train --cpu\n" + notebook.train.format(batch=notebook.batch, fail="True",
                                                                                slow="0")))
        slow = notebook.train.format(batch=notebook.batch, fail="False", slow="10")  # 10 s a step
        where[engine]["timeout"] = len(cells)
        cells.append(new_code_cell("%%ddp_train --cpu --timeout 8\n" + slow))
        where[engine]["interrupt"] = len(cells)
        cells.append(new_code_cell("%%ddp_train --cpu\n" + slow))
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    client = NotebookClient(nb, timeout=400, allow_errors=True, resources={"metadata": {"path": str(tmp_path)}})
    interrupted = {where[engine]["interrupt"] for engine in ENGINES}
    missed: list[AssertionError] = []

    def press_stop_in_a_step(runs_before: set) -> None:  # the stop button (SIGINT to the kernel) mid-training
        try:
            wait_until(lambda: in_a_step(set((tmp_path / "runs").iterdir()) - runs_before), 120,
                       "both ranks of the run to stop in a 10 s step (their logs)", every=0.2)
        except AssertionError as exc:  # (the test fails with it below; the stop button is pressed all the same)
            missed.append(exc)
        run_sync(client.km.interrupt_kernel)()

    def press_stop_soon(cell, cell_index, **_):
        if cell_index in interrupted:
            before = set((tmp_path / "runs").iterdir()) if (tmp_path / "runs").is_dir() else set()
            threading.Thread(target=press_stop_in_a_step, args=(before,), daemon=True).start()

    client.on_cell_execute = press_stop_soon
    client.execute()
    assert not missed, missed

    def text(index: int) -> str:
        parts = []
        for o in nb.cells[index].outputs:
            parts += [o.get("text", "") or o.get("data", {}).get("text/plain", ""), o.get("evalue", ""),
                      *o.get("traceback", [])]
        return "\n".join(parts)

    assert "LIGHTNING REFUSED: Cannot re-initialize CUDA in forked subprocess" in text(where["lightning"]["peer"])
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 4 * len(ENGINES)
    for number, engine in enumerate(ENGINES):
        ok, failed, timed_out, stopped = runs[4 * number: 4 * number + 4]
        assert "[nbddp] succeeded in" in text(where[engine]["train"]), (engine, text(where[engine]["train"]))
        assert "kernel loss" in text(where[engine]["train"] + 1)  # on the trained weights, not the kernel's own
        assert kernel_weights(text(where[engine]["train"] + 1)) == pytest.approx(weights_sum(reference(engine)), abs=2e-3)
        assert_weights(ok, reference(engine), engine)
        if number:  # the libraries' notebooks share the kernel's warm ranks, after each other's failures
            assert "on a warm rank" in (ok / "logs" / "rank-0.log").read_text()
        failure = text(where[engine]["fail"])
        line = next(i for i, source in enumerate(NOTEBOOKS[engine].setup.splitlines(), 2)  # (1: the directive)
                    if "rank 1 fails on purpose" in source)
        setup_count = nb.cells[where[engine]["setup"]].execution_count
        assert "rank 1 raised ValueError: rank 1 fails on purpose" in failure, (engine, failure)
        assert f"In [{setup_count}], line {line}" in failure, (engine, failure)
        assert "--timeout" in text(where[engine]["timeout"]), (engine, text(where[engine]["timeout"]))
        assert "KeyboardInterrupt" in text(where[engine]["interrupt"]), (engine, text(where[engine]["interrupt"]))
        statuses = [json.loads((d / "result.json").read_text())["status"] for d in (ok, failed, timed_out, stopped)]
        assert statuses == ["succeeded", "failed", "timeout", "interrupted"], (engine, statuses)
    pids = set().union(*(_rank_pids(d) for d in runs))

    def running() -> set[int]:
        left = set()
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.add(pid)
            except psutil.NoSuchProcess:
                pass
        return left

    wait_until(lambda: not running(), 10, "the kernel is gone: so are its warm ranks", every=0.2,
               detail=lambda: f"ranks alive: {sorted(running())}")
