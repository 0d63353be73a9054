"""``papermill --engine nbddp``: papermill's own behaviour for every notebook, with the ``ddp-train`` cells
run as a real DDP job (2 CPU ranks). papermill runs as its users run it (its CLI, its Python API).

The comparison with papermill's own engine on papermill's own test notebooks is
tests/test_papermill_parity.py; here are the DDP-specific cases.
"""

import json
import os
import re
import signal
import subprocess
import sys

import nbformat
import papermill
import pytest

from tests.conftest import code, descendants, alive, wait_until, write_notebook
from tests.linear_fit import EVALUATE, SETUP, assert_matches, train_cell
from tests.test_trackers import DIVERGES, EPOCHS as TRACKED_EPOCHS, SETUP as TRACKED_SETUP, mlflow_history, \
    assert_one_record, mlflow_runs, tensorboard_points, trackers_here, wandb_records, wandb_run_facts, \
    writes_on_every_rank  # noqa: F401 - trackers_here: a fixture

pytestmark = pytest.mark.slow
OPTIONS = {"NBDDP_OPTIONS": "--cpu --nproc 2"}


def papermill_cli(args, cwd, env=None, interrupt_when=None, timeout=240):
    """``python -m papermill ARGS`` in a session of its own: ``(exit code, stdout, stderr, pids it had)``; Ctrl-C
    once ``interrupt_when()`` is true."""
    proc = subprocess.Popen([sys.executable, "-m", "papermill", *map(str, args)], cwd=cwd,
                            env={**os.environ, **OPTIONS, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = set()

    def exited() -> bool:
        nonlocal interrupt_when
        seen.update(descendants(proc.pid))
        if interrupt_when is not None and interrupt_when():
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole foreground group
            interrupt_when = None
        return proc.poll() is not None

    try:
        wait_until(exited, timeout, f"papermill {' '.join(map(str, args))} exited")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err, seen


def gone(pids, seconds=10.0) -> bool:
    """Every one of ``pids`` ends within ``seconds``, or the test fails naming those left."""
    wait_until(lambda: not any(alive(p) for p in pids), seconds, "every process papermill had ended",
               detail=lambda: f"still alive: {sorted(p for p in pids if alive(p))}")
    return True


def training_in_a_new_run(folder, step: int = 2):
    """A condition: a run started after this call (a new folder under ``folder``/runs) has rank 1 at ``step``."""
    runs = folder / "runs"
    before = set(runs.iterdir()) if runs.is_dir() else set()

    def training() -> bool:
        for run in (set(runs.iterdir()) if runs.is_dir() else set()) - before:
            log = run / "logs" / "rank-1.log"
            if log.exists() and f"step {step}" in log.read_text(errors="replace"):
                return True
        return False

    return training


def statuses(path):
    nb = nbformat.read(path, as_version=4)
    return [c.metadata.get("papermill", {}).get("status") for c in nb.cells if c.cell_type == "code"]


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
    assert nb.cells[3].execution_count == 4  # the kernel received the training cell: In [4]
    assert "lr in the kernel 0.05" in texts[4]
    assert [c.metadata.papermill.status for c in nb.cells] == ["completed"] * 5
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert_matches(run_dir / "weights.pt", batch=16)  # lr=0.05 reached the ranks
    result = json.loads((run_dir / "result.json").read_text())
    assert result["overrides"] == {"lr": 0.05} and result["parameters"]["lr"] == 0.05
    assert "-p lr 0.05" in result["command"]
    assert nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[4].outputs  # papermill wrote it


def test_a_notebook_without_a_training_cell_runs_as_papermills_own_engine_runs_it(tmp_path):
    write_notebook(tmp_path / "plain.ipynb", [code("x = 1", "parameters"), code("print('x is', x)"),
                                              code("import sys; print('to stderr', file=sys.stderr)")])
    ours = papermill.execute_notebook(str(tmp_path / "plain.ipynb"), str(tmp_path / "ours.ipynb"), parameters={"x": 2},
                                      engine_name="nbddp", progress_bar=False, cwd=str(tmp_path))
    theirs = papermill.execute_notebook(str(tmp_path / "plain.ipynb"), str(tmp_path / "theirs.ipynb"),
                                        parameters={"x": 2}, progress_bar=False, cwd=str(tmp_path))
    outputs = [[(o.output_type, o.get("name"), o.get("text")) for o in c.get("outputs", [])] for c in ours.cells]
    assert outputs == [[(o.output_type, o.get("name"), o.get("text")) for o in c.get("outputs", [])]
                       for c in theirs.cells]
    assert "x is 2" in outputs[2][0][2] and statuses(tmp_path / "ours.ipynb") == ["completed"] * 4
    assert not (tmp_path / "runs").exists()  # nothing to train: no DDP job


@pytest.mark.beside  # (it writes the run to the three trackers too: they take their time)
def test_a_failing_rank_is_a_papermill_execution_error_and_exit_1_and_the_trackers_asked_for_mark_it_failed(
        trackers_here):  # noqa: F811 - the fixture imported above
    """papermill's own failure, where the training cell is: exit 1, a PapermillExecutionError at the kernel's count,
    the cells after it pending. With ``--track mlflow,tensorboard,wandb`` (NBDDP_OPTIONS) and no tracker in the
    training, nbddp writes the run to each itself: its parameters, its nbddp.log points with their steps, how it
    ended. The kernel's own MLflow run, opened before the training, is the run; W&B and TensorBoard get nbddp's."""
    from mlflow.tracking import MlflowClient

    folder = trackers_here
    write_notebook(folder / "boom.ipynb", [code("lr = 0.05", "parameters"), code(TRACKED_SETUP),
                                           code("import mlflow\nmlflow.start_run(run_name='notebook')"),
                                           code(DIVERGES.format(epochs=TRACKED_EPOCHS).replace(  # (and a writer
                                               "torch.distributed.barrier()",  # on every rank, with no guard)
                                               writes_on_every_rank(folder / "tb") + "\ntorch.distributed.barrier()")),
                                           code("print('EVALUATION RAN')")])
    code_, out, err, _ = papermill_cli(["--engine", "nbddp", "boom.ipynb", "out.ipynb", "-p", "lr", "0.3"], folder, env={
        "NBDDP_OPTIONS": "--cpu --nproc 2 --track mlflow,tensorboard,wandb", "WANDB_MODE": "offline"})
    assert code_ == 1, err
    assert "PapermillExecutionError" in err and "rank 1 raised ValueError: diverged at lr 0.3" in err
    assert 'Exception encountered at "In [5]"' in err  # the kernel's count for the training cell, not In [None]
    assert statuses(folder / "out.ipynb") == ["completed"] * 4 + ["failed", "pending"]
    assert "EVALUATION RAN" not in out + err and "nbddp: warning" not in err, err
    epochs = range(TRACKED_EPOCHS)
    [run] = mlflow_runs(folder)  # the kernel's, with nbddp's record of the run
    assert run.info.run_name == "notebook" and run.info.status == "FAILED" and run.data.params["lr"] == "0.3"
    assert run.data.tags["nbddp.status"] == "failed", run.data.tags
    # (cell 5 of the notebook papermill runs: its parameters injected)
    assert re.match(r"rank 1, cell 5, line 14: ValueError: diverged at lr 0.3", run.data.tags["nbddp.error"])
    accuracy = [(m.step, m.value) for m in mlflow_history(folder, run, "accuracy")]
    assert accuracy == [(epoch, 0.5 + epoch / 10) for epoch in epochs]
    artifacts = {a.path for a in MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").list_artifacts(run.info.run_id,
                                                                                                  "nbddp")}
    assert "nbddp/result.json" in artifacts <= {"nbddp/result.json", "nbddp/weights.pt"}  # (rank 0's, if it got to
    # save them before rank 1's failure stopped it; papermill writes its notebook itself)
    [run_dir] = (folder / "runs").iterdir()
    assert_one_record(folder / "tb")  # rank 0's writer alone, and nbddp's record in its folder (the code's record)
    assert tensorboard_points(folder / "tb", "nbddp/accuracy") == pytest.approx([0.5 + epoch / 10 for epoch in epochs])
    [wandb_file] = folder.rglob("offline-run-*/run-*.wandb")
    group, name, config = wandb_run_facts(wandb_file)
    assert name == run_dir.name and config["lr"] == 0.3 and config["nbddp"]["nbddp.status"] == "failed"
    records = list(wandb_records(wandb_file))
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["accuracy"]) for h in history] == [(epoch, 0.5 + epoch / 10) for epoch in epochs]
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [1]


SLEEPY_TRAINING = "#| ddp-train\nfor step in range(600):\n    print('step', step, flush=True)\n    time.sleep(0.1)"


@pytest.mark.waits  # mostly a timeout or a mid-training signal: runs beside the rest in .ci/run
def test_time_limits_and_ctrl_c_end_the_run_non_zero_with_no_rank_left(tmp_path):
    """--execution-timeout on the training cell stops the job (a PapermillExecutionError, as a timed-out
    cell of papermill's is an error); on a kernel cell it is papermill's own CellTimeoutError; Ctrl-C exits
    as papermill does (click's "Aborted!", 1). Every rank stopped each time, the run recorded."""
    write_notebook(tmp_path / "long.ipynb", [code("lr = 0.05", "parameters"), code(SETUP), code(SLEEPY_TRAINING),
                                             code("print('EVALUATION RAN')")])
    # (25 s: the setup cell's import of torch beside the ranks' own, under CI's other lanes, took over 8; the training
    # cell sleeps 60)
    code_, out, err, pids = papermill_cli(["--engine", "nbddp", "long.ipynb", "a.ipynb", "--execution-timeout", "25"],
                                          tmp_path)
    assert code_ == 1 and "RunTimeout: the run exceeded papermill's --execution-timeout (25s)" in err, err
    assert statuses(tmp_path / "a.ipynb")[2] == "failed" and gone(pids)

    code_, out, err, pids = papermill_cli(["--engine", "nbddp", "long.ipynb", "b.ipynb"], tmp_path,
                                          interrupt_when=training_in_a_new_run(tmp_path))  # Ctrl-C mid-training
    assert code_ != 0 and "Aborted!" in err and "EVALUATION RAN" not in out + err, err
    assert gone(pids)

    write_notebook(tmp_path / "slowcell.ipynb", [code("lr = 0.05", "parameters"), code(SETUP),
                                                 code("import time; time.sleep(60)"), code(SLEEPY_TRAINING)])
    code_, out, err, pids = papermill_cli(["--engine", "nbddp", "slowcell.ipynb", "c.ipynb", "--execution-timeout",
                                           "5"], tmp_path)
    assert code_ == 1 and "CellTimeoutError" in err and "A cell timed out while it was being executed" in err, err
    assert gone(pids)
    ended = sorted(json.loads(r.read_text())["status"] for r in (tmp_path / "runs").glob("*/result.json"))
    assert ended == ["interrupted", "timeout", "timeout"]


def test_a_parameters_directive_is_papermills_parameters_cell_and_an_unknown_name_is_injected_with_a_hint(tmp_path):
    """papermill's CLI with ``-p`` on a ``#| parameters`` notebook: the values reach the ranks (a run with the
    defaults and exit 0 was the defect); a name the cell doesn't define is injected, as papermill does,
    with a warning naming the defined name it is closest to."""
    write_notebook(tmp_path / "fit.ipynb", [code("#| parameters\nlr = 0.01"), code(SETUP),
                                             code(train_cell(8).replace("lr=0.05", "lr=lr")),
                                             code(EVALUATE + "\nprint('learning_rate in the kernel', learning_rate)")])
    code_, _, err, _ = papermill_cli(["--engine", "nbddp", "fit.ipynb", "out.ipynb", "-p", "lr", "0.05",
                                      "-p", "learning_rate", "0.3"], tmp_path)
    assert code_ == 0, err
    assert "Passed unknown parameter: lr" not in err and "does not contain a cell with tag" not in err
    assert "Passed unknown parameter: learning_rate" in err  # papermill's own warning, as with its engine
    assert "-p learning_rate: the parameters cell doesn't define it (did you mean lr? injected anyway" in err
    nb = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert nb.cells[0].source.startswith("#| parameters") and "parameters" in nb.cells[0].metadata.tags
    assert "injected-parameters" in nb.cells[1].metadata.tags  # right after the directive cell
    assert "learning_rate in the kernel 0.3" in "".join(o.get("text", "") for o in nb.cells[4].outputs)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert_matches(run_dir / "weights.pt", batch=16)  # lr=0.05 reached the ranks
    result = json.loads((run_dir / "result.json").read_text())
    assert result["overrides"] == {"lr": 0.05, "learning_rate": 0.3}


def test_refusals_run_nothing_write_nothing_and_say_why_in_one_line(tmp_path):
    write_notebook(tmp_path / "fit.ipynb", [code("lr = 0.05", "parameters"), code(SETUP), code(train_cell(8))])
    code_, _, err, _ = papermill_cli(["--engine", "nbddp", "fit.ipynb", "a.ipynb"], tmp_path,
                                     env={"NBDDP_OPTIONS": "--nproc 0"})
    assert code_ == 1 and "nbddp: error: NBDDP_OPTIONS='--nproc 0': --nproc 0: need at least 1 process." in err
    assert "nbddp run --help" in err and "See NBDDP_OPTIONS --help" not in err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("nbddp: error: "), err
    write_notebook(tmp_path / "typo.ipynb", [code("#| ddp-trian\nprint(1)")])
    code_, _, err, _ = papermill_cli(["--engine", "nbddp", "typo.ipynb", "c.ipynb"], tmp_path)
    assert code_ == 1 and "nbddp: error: typo.ipynb: cell 1, line 1: unknown directive '#| ddp-trian'" in err
    assert "Traceback" not in err
    assert not any((tmp_path / name).exists() for name in ("a.ipynb", "c.ipynb"))
    assert not (tmp_path / "runs").exists()


def test_a_refusal_is_an_nbddp_engine_error_from_python_and_pickles(tmp_path, monkeypatch):
    import pickle

    from nbddp.doors.papermill import NbddpEngineError

    monkeypatch.setenv("NBDDP_OPTIONS", "--nproc 0")
    write_notebook(tmp_path / "fit.ipynb", [code("lr = 0.05", "parameters"), code(SETUP), code(train_cell(8))])
    with pytest.raises(NbddpEngineError, match="--nproc 0: need at least 1 process") as raised:
        papermill.execute_notebook(str(tmp_path / "fit.ipynb"), str(tmp_path / "out.ipynb"), engine_name="nbddp",
                                   progress_bar=False)
    assert str(pickle.loads(pickle.dumps(raised.value))) == str(raised.value)


def test_papermills_options_mean_what_they_mean_for_a_ddp_notebook(tmp_path):
    """-k (a kernelspec of the test's own), --cwd, --log-output (rank lines as they come), --stdout-file,
    --report-mode, autosave while the training runs; and ``-`` as the output: the notebook alone on stdout."""
    spec = tmp_path / "jupyter" / "kernels" / "marked"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"], "display_name": "marked",
        "language": "python", "env": {"KERNEL_MARK": "the -k kernel"}}))
    work = tmp_path / "work"
    work.mkdir()
    training = SLEEPY_TRAINING.replace("600", "40").replace("0.1", "0.2")
    write_notebook(tmp_path / "fit.ipynb", [code("lr = 0.05", "parameters"), code(SETUP),
                                            code("import os; print('kernel:', os.environ.get('KERNEL_MARK'))"),
                                            code(training), code(EVALUATE)])
    env = {"JUPYTER_PATH": str(tmp_path / "jupyter")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "papermill", "--engine", "nbddp", str(tmp_path / "fit.ipynb"), str(tmp_path / "out.ipynb"),
         "-k", "marked", "--cwd", str(work), "--log-output", "--stdout-file", str(tmp_path / "stdout.txt"),
         "--report-mode", "--autosave-cell-every", "1"],
        env={**os.environ, **OPTIONS, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    saved_mid_run = ""

    def exited() -> bool:
        nonlocal saved_mid_run
        text = (tmp_path / "out.ipynb").read_text() if (tmp_path / "out.ipynb").exists() else ""
        if not saved_mid_run and "[rank 1] step " in text:  # the first save the test sees with a rank's line
            saved_mid_run = text
        return proc.poll() is not None

    try:
        wait_until(exited, 240, "papermill exited", every=0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = proc.communicate()
    assert proc.returncode == 0, err
    # autosaved while training: 8 s of it, a save every second asked, the test looking every half second (papermill
    # doubles the interval after each save that took over a quarter of it, as saves do on a loaded machine)
    assert saved_mid_run and "[rank 1] step 39" not in saved_mid_run, saved_mid_run
    assert err.index("[rank 1] step 5") < err.index("Ending Cell 5")  # logged as they came, in the cell
    stdout_file = (tmp_path / "stdout.txt").read_text()
    assert "kernel: the -k kernel" in stdout_file and "[rank 0] step 39" in stdout_file
    assert "kernel sees weight sum" in stdout_file
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert all(c.metadata.get("jupyter", {}).get("source_hidden") for c in out.cells if c.cell_type == "code")
    assert list((work / "runs").iterdir())  # the run dir in --cwd

    done = subprocess.run([sys.executable, "-m", "papermill", "--engine", "nbddp", str(tmp_path / "fit.ipynb"), "-",
                           "--cwd", str(work)], env={**os.environ, **OPTIONS}, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    printed = nbformat.reads(done.stdout, as_version=4)  # nothing but the notebook on stdout
    assert "[rank 0] step 39" in "".join(o.get("text", "") for o in printed.cells[3].outputs)
