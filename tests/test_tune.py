"""Hyperparameter search on warm ranks (``nbddp tune``, ``nbddp.tune``, ``nbddp.objective``) with real Optuna studies.

The slow tests run real studies: 2 gloo ranks per trial, a real ipykernel (nbclient) for ``nbddp.objective``, a real
SQLite storage for a resumed ``nbddp tune``. The fast ones check the search space's grammar and the refusals; one uses
a stand-in for the trials (a policy test: which names a space may give), said where it does.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from nbddp.contracts.errors import UsageError
from nbddp.doors.tune.objective import Objective, TrialEnd, trial_dir
from nbddp.doors.tune.space import parse_space, probed_names
from nbddp.plan.options import LaunchOptions
from tests.conftest import code, wait_until, write_notebook

optuna = pytest.importorskip("optuna")

PARAMS = "lr = 0.1\nhidden = 8\nepochs = 4\nnap = 0.0\nfail_at = -1.0"
# The model is the setup's, trained in place by every trial: the warm ranks must put it back between trials for a
# trial to give a fresh run's weights.
SETUP = ("#| ddp\nimport time\nimport torch\nimport nbddp\ntorch.manual_seed(0)\nX = torch.randn(64, 4)\n"
         "Y = X.sum(1, keepdim=True)\n"
         "model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))")
BODY = ("if lr == fail_at:\n    raise ValueError(f'diverged at lr={lr}')\n"
        "ddp_model = nbddp.prepare(model)\n"
        "opt = torch.optim.SGD(ddp_model.parameters(), lr=lr)\n"
        "for epoch in range(epochs):\n"
        "    opt.zero_grad()\n"
        "    loss = ((ddp_model(X) - Y) ** 2).mean()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    time.sleep(nap)\n"
        "    nbddp.log(val_loss=loss.item(), step=epoch)")


def _notebook(path: Path) -> Path:
    return write_notebook(path, [code(PARAMS, "parameters"), code(SETUP), code("#| ddp-train\n" + BODY),
                                 code("print(model)")])


# ---------------------------------------------------------------- the search space


def test_the_space_grammar_is_optunas_own_suggestions():
    space = parse_space(["lr=loguniform(1e-4,1e-1)", "hidden=int(16,256)", "drop=uniform(0,0.5)",
                         "opt=choice(adam, 'sgd', 3)", "layers=logint(1,8)", "wd=float(0,1,0.25)"])
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    values = space(trial)
    assert set(values) == {"lr", "hidden", "drop", "opt", "layers", "wd"}
    assert 1e-4 <= values["lr"] <= 1e-1 and isinstance(values["hidden"], int) and values["opt"] in ("adam", "sgd", 3)
    assert values["wd"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    distributions = trial.distributions
    assert distributions["lr"].log and not distributions["drop"].log and distributions["layers"].log
    assert probed_names(space) == ("lr", "hidden", "drop", "opt", "layers", "wd")


@pytest.mark.parametrize(("spec", "said"), [
    ("lr=logg(1,2)", "unknown distribution 'logg'"),
    ("lr=loguniform(0.5)", "loguniform(...) takes low, high, numbers"),
    ("lr=loguniform(0,1)", "a log scale starts above 0"),
    ("lr=uniform(2,1)", "low (2) must be below high (1)"),
    ("hidden=int(1.5,3)", "int(...) takes whole numbers"),
    ("lr=uniform(a,1)", "'a' is not a number or a literal"),
    ("lr=uniform(1,2,3,4)", "takes low, high[, step], numbers"),
    ("lr", "write NAME=DIST(...)"),
    ("1lr=uniform(0,1)", "write NAME=DIST(...)"),
    ("lr=uniform(0,1", "is not DIST(...)"),
    ("lr=__import__('os')", "unknown distribution '__import__'"),
    ("lr=os.system('x')", "is not DIST(...)"),
    ("x=choice()", "needs at least one value"),
])
def test_a_malformed_space_is_refused_in_one_line(spec, said):
    with pytest.raises(UsageError) as caught:
        parse_space([spec])
    assert said in str(caught.value) and len(str(caught.value).splitlines()) == 1
    with pytest.raises(UsageError, match="lr is given twice"):
        parse_space(["lr=uniform(0,1)", "lr=uniform(0,2)"])
    with pytest.raises(UsageError, match="give the search space"):
        parse_space([])


class _StandIn:
    """A stand-in for a door's trials (what a training cell takes): the name check is a policy of the objective's."""

    runs = Path("runs")
    launch = LaunchOptions(parameters={"epochs": 3})
    fixed = ("epochs",)

    def takes(self):
        return ("lr", "hidden", "epochs")

    def run(self, *args):  # pragma: no cover - never reached: the space is refused first
        raise AssertionError("no trial may run")


def test_a_space_giving_a_name_the_code_doesnt_read_is_refused_before_the_first_trial():
    with pytest.raises(UsageError) as caught:
        Objective(_StandIn(), lambda trial: {"lrr": trial.suggest_float("lrr", 0.1, 1)}, "val_loss", None)
    assert str(caught.value) == ("the search space gives lrr, which the training code doesn't read; it reads lr, "
                                 "hidden, epochs. Did you mean lr?")
    with pytest.raises(UsageError, match=r"^epochs: both fixed \(-p\) and searched \(the space\): drop one"):
        Objective(_StandIn(), lambda trial: {"epochs": trial.suggest_int("epochs", 1, 9)}, "val_loss", None)
    with pytest.raises(UsageError, match="must return a dict"):
        Objective(_StandIn(), lambda trial: [trial.suggest_float("lr", 0.1, 1)], "val_loss", None)
    with pytest.raises(UsageError, match="name the value rank 0 logs"):
        Objective(_StandIn(), lambda trial: {}, [], None)


def test_without_optuna_one_line_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(UsageError, match=r"^hyperparameter search needs Optuna: pip install 'nbddp\[tune\]'"):
        Objective(_StandIn(), lambda trial: {}, "val_loss", None)


def test_a_trial_is_one_line_and_a_study_name_is_never_a_path(tmp_path):
    assert TrialEnd(3, {"lr": 0.0123456, "opt": "adam"}, "COMPLETE", (0.5,), 9, 1.234).line() == \
        "trial 3 · lr=0.01235 opt=adam · 0.5 · 1.2 s"
    assert TrialEnd(4, {"lr": 0.1}, "PRUNED", step=2, seconds=0.31).line() == "trial 4 · lr=0.1 · PRUNED at step 2 · 0.3 s"
    assert TrialEnd(5, {}, "FAIL", error="rank 1: ValueError: x").line() == \
        "trial 5 · (no values) · FAIL: rank 1: ValueError: x · 0.0 s"
    assert trial_dir(tmp_path, "../../etc\n$(rm -rf ~)", 2) == tmp_path / "_.._etc___rm_-rf___" / "trial-2"
    (tmp_path / "s" / "trial-0").mkdir(parents=True)
    assert trial_dir(tmp_path, "s", 0) == tmp_path / "s" / "trial-0-2"


# ---------------------------------------------------------------- nbddp tune, headless


def _tune(tmp_path, *more):
    return ["tune", "tune.ipynb", "--cpu", "--nproc", "2", "--metric", "val_loss", *more]


def _records(folder: Path) -> dict[int, dict]:
    records = {}
    for result in folder.glob("trial-*/result.json"):
        record = json.loads(result.read_text())
        records[record["study"]["trial"]] = record
    return records


@pytest.mark.slow  # (it asserts a time: in the main lane, where the load is steadier)
def test_nbddp_tune_prunes_a_trial_within_a_second_of_its_report_and_goes_on_warm_past_a_failed_one(tmp_path, cli_run):
    _notebook(tmp_path / "tune.ipynb")
    # The study's trials, given ahead in its storage (Optuna's enqueue_trial): five that complete (MedianPruner's
    # startup trials) around one that fails; a slow one with a tiny lr, worse than the median at step 1 and pruned
    # there; then trial 5's values again, on the same warm ranks after a pruned trial: the same value (as trial 3's is
    # trial 0's after a failed one).
    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="s", storage=storage)
    for lr, nap in ((0.05, 0.0), (0.06, 0.0), (0.5, 0.0), (0.05, 0.0), (0.06, 0.0), (0.07, 0.0), (0.0001, 0.25),
                    (0.07, 0.0)):
        study.enqueue_trial({"lr": lr, "nap": nap})
    run = cli_run([*_tune(tmp_path, "--trials", "8", "--space", "lr=choice(0.05, 0.06, 0.07, 0.0001, 0.5)",
                          "--space", "nap=choice(0.0, 0.25)", "--study-name", "s", "--storage", "sqlite:///s.db",
                          "-p", "epochs", "12", "-p", "fail_at", "0.5", "--track", "mlflow")], tmp_path,
                  env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    assert run.wait(timeout=240) == 0, run.output
    records = _records(tmp_path / "runs" / "s")
    states = [records[n]["study"]["state"] for n in sorted(records)]
    assert states == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE", "COMPLETE", "COMPLETE", "PRUNED", "COMPLETE"], \
        run.output
    pruned = records[6]
    step = pruned["study"]["step"]
    logged = [json.loads(line) for line in (Path(pruned["script"]).parent / "metrics.jsonl").read_text().splitlines()]
    reported = next(r["time"] for r in logged if r.get("step") == step)
    assert pruned["ended_at"] - reported < 1.0, (pruned["ended_at"] - reported, logged)
    print("stopped", pruned["ended_at"] - reported, "s after the report")
    assert max(r["step"] for r in logged) < 11  # (the job was stopped: it never got to its end)
    assert pruned["status"] == "interrupted" and "pruned at step" in pruned["error"]
    assert "trial 2 · lr=0.5 nap=0 · FAIL: rank" in run.output and "ValueError: diverged at lr=0.5" in run.output
    assert "on a warm rank" in (tmp_path / "runs" / "s" / "trial-7" / "logs" / "rank-0.log").read_text()  # (a prune)
    assert records[7]["study"]["values"] == records[5]["study"]["values"]
    assert records[3]["study"]["values"] == records[0]["study"]["values"]
    assert "best: trial 5 · val_loss=" in run.output
    assert optuna.load_study(study_name="s", storage=storage).best_trial.user_attrs["run_dir"] == \
        str(tmp_path / "runs" / "s" / "trial-5")
    # --track mlflow: a record per trial, nested under one parent run named by the study (as a batch's are)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    [parent] = [r for r in runs if "nbddp.batch" in r.data.tags]
    children = [r for r in runs if r is not parent]
    assert parent.info.run_name == "s" and len(children) == 8
    assert parent.info.status == "FINISHED"  # (a pruned and a failed trial are a study's normal work)
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert run.leftovers() == set()


@pytest.mark.slow
@pytest.mark.beside
def test_a_killed_nbddp_tune_resumes_its_study_and_runs_the_interrupted_trial_again(tmp_path, cli_run):
    _notebook(tmp_path / "tune.ipynb")
    args = _tune(tmp_path, "--trials", "3", "--space", "lr=loguniform(1e-3,0.5)", "--space", "hidden=int(4,16)",
                 "--storage", "sqlite:///study.db", "--pruner", "none", "--seed", "1", "-p", "nap", "0.4",
                 "-p", "epochs", "6")
    first = cli_run(args, tmp_path)
    first.wait_for("trial 0 ·", timeout=120)

    def states() -> list[tuple[str]]:
        with sqlite3.connect(tmp_path / "study.db") as db:
            return db.execute("select state from trials order by number").fetchall()

    def params() -> int:
        with sqlite3.connect(tmp_path / "study.db") as db:
            return db.execute("select count(*) from trial_params").fetchone()[0]

    wait_until(lambda: states() == [("COMPLETE",), ("RUNNING",)] and params() == 4, 30,
               "trial 0 recorded, trial 1 running with its values")
    os.kill(first.proc.pid, signal.SIGKILL)  # nbddp tune alone, in trial 1: its warm ranks follow it
    first.proc.wait()
    assert first.leftovers() == set()
    assert states() == [("COMPLETE",), ("RUNNING",)]
    second = cli_run(args, tmp_path)
    assert second.wait(timeout=240) == 0, second.output
    assert "trial 1 was running when the study's last process stopped: marked FAIL; its values run again" \
        in second.output
    study = optuna.load_study(study_name="tune", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"], second.output
    assert study.trials[2].params == study.trials[1].params  # the interrupted trial's values, run again
    assert study.trials[3].params != study.trials[0].params  # (a resumed study's seed goes on)
    assert second.leftovers() == set()
    # SIGTERM (a `kill`): the running trial's job stops, the trial is marked interrupted; the study resumes it first
    more = [*args[:args.index("--trials") + 1], "4", *args[args.index("--trials") + 2:]]
    third = cli_run(more, tmp_path)
    log = tmp_path / "runs" / "tune" / "trial-4" / "logs" / "rank-0.log"  # (its job on the ranks: stopped there)
    wait_until(lambda: len(states()) == 5 and params() == 10 and log.exists() and "setup" in log.read_text(), 60,
               "trial 4 training with its values")
    os.kill(third.proc.pid, signal.SIGTERM)
    assert third.wait(timeout=60) == 143, third.output
    assert "study stopped by SIGTERM" in third.output and third.leftovers(grace=15) == set()
    fourth = cli_run(more, tmp_path)
    assert fourth.wait(timeout=120) == 0, fourth.output
    assert "trial 4 was interrupted; its values run again first" in fourth.output
    study = optuna.load_study(study_name="tune", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert [t.state.name for t in study.trials][4:] == ["FAIL", "COMPLETE"]
    assert study.trials[5].params == study.trials[4].params


# ---------------------------------------------------------------- nbddp.objective, in a kernel


def _kernel_notebook(*sources: str):
    cells = [new_code_cell("%load_ext nbddp"), new_code_cell("lr = 0.05\nhidden = 8\nepochs = 8\nnap = 0.0\nfail_at = 0.5"),
             new_code_cell(SETUP), new_code_cell("%%ddp_train --cpu --nproc 2\n" + BODY),
             *(new_code_cell(source) for source in sources)]
    return new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                              "language": "python"}})


STUDY = """\
import optuna, time
from nbddp.doors.jupyter.kernel_pool import kernel_pool
ranks = kernel_pool.live().launch.pid
def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-4, 0.5, log=True), "nap": trial.suggest_categorical("nap", [0.0, 0.3])}
study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=4))
for lr, nap in ((0.05, 0.0), (0.06, 0.0), (0.5, 0.0), (0.04, 0.0), (0.07, 0.0), (0.0001, 0.3), (0.07, 0.0)):
    study.enqueue_trial({"lr": lr, "nap": nap})
study.optimize(nbddp.objective(space, metric="val_loss"), n_trials=7)
assert kernel_pool.live().launch.pid == ranks  # every trial on the kernel's warm ranks
print("STATES", " ".join(t.state.name for t in study.trials))
"""
FRESH = "%%ddp_train --cpu --nproc 2 --fresh -p lr 0.07\n" + BODY
SAME = """\
import torch
from nbddp.contracts.checkpoint import load_returns
states, _ = load_returns(study.trials[4].user_attrs["run_dir"] + "/weights.pt")
fresh = model if isinstance(model, dict) else model.state_dict()  # (the cell built it: its state comes back)
assert states["model"].keys() == fresh.keys()
assert all(torch.equal(states["model"][k], v) for k, v in fresh.items())
assert study.trials[6].value == study.trials[4].value
print("SAME WEIGHTS")
"""
BOTH = """\
two = optuna.create_study(directions=["minimize", "minimize"])
two.enqueue_trial({"lr": 0.05, "nap": 0.0})
two.optimize(nbddp.objective(space, metric=["val_loss", "step"]), n_trials=1)
print("TWO", two.trials[0].values)
try:
    nbddp.objective(lambda trial: {"lrr": trial.suggest_float("lrr", 0.1, 1.0)})
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc)
doubled = optuna.create_study()
doubled.enqueue_trial({"lr": 0.05, "nap": 0.0})
doubled.optimize(nbddp.objective(space, value=lambda result: 2 * result.record.final_metrics["val_loss"]), n_trials=1)
print("VALUE", doubled.trials[0].value / two.trials[0].values[0])
file = optuna.create_study()
file.optimize(nbddp.objective(lambda t: {"lr": t.suggest_float("lr", 0.01, 0.1)}, notebook="tune.ipynb",
                              options="--cpu --nproc 2"), n_trials=2)
print("NOTEBOOK", " ".join(t.state.name for t in file.trials), file.trials[0].user_attrs["run_dir"])
threads = optuna.create_study()
threads.optimize(nbddp.objective(space), n_trials=3, n_jobs=2)
print("THREADS", sorted(t.state.name for t in threads.trials))
nan = optuna.create_study()
nan.optimize(nbddp.objective(lambda t: {"lr": t.suggest_float("lr", 0.01, 0.1)},
                             cell="nbddp.log(val_loss=lr, step=0)\\nnbddp.log(val_loss=float('nan'), step=1)"), n_trials=1)
print("NAN", nan.trials[0].state.name, nan.trials[0].user_attrs["error"])
"""


@pytest.mark.slow
@pytest.mark.beside
def test_nbddp_objective_runs_optunas_loop_over_the_kernels_training_cell_on_its_warm_ranks(tmp_path):
    nb = _kernel_notebook(STUDY, FRESH, SAME, BOTH)
    _notebook(tmp_path / "tune.ipynb")  # (a notebook's training cells as the trials: notebook=)
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    out = "\n".join(_text(cell) for cell in nb.cells)
    assert "STATES COMPLETE COMPLETE FAIL COMPLETE COMPLETE PRUNED COMPLETE" in out, out
    assert "SAME WEIGHTS" in out  # a trial's weights are a --fresh run's with the same values
    assert "TWO [" in out and ", 7.0]" in out  # (several objectives: each metric's last value; 8 epochs → step 7)
    assert "REFUSED UsageError the search space gives lrr, which the training code doesn't read; it reads " in out
    assert "VALUE 2.0" in out  # value=: the trial's value from the run's result
    assert "NOTEBOOK COMPLETE COMPLETE " in out and "/runs/" in out  # notebook=: its training cells, its runs/
    # n_jobs=2: the trials share one set of warm ranks, so they run one after another, said once
    assert "THREADS ['COMPLETE', 'COMPLETE', 'COMPLETE']" in out and out.count("run one after another") == 1
    # cell=: the trial's code given; a metric whose last value is NaN fails the trial (not its last finite value)
    assert "NAN FAIL val_loss was nan at step 1 (the training diverged?)" in out
    study_out = _text(nb.cells[4])
    assert "trial 2 · lr=0.5 nap=0 · FAIL: rank" in study_out and "ValueError: diverged at lr=0.5" in study_out
    assert "trial 5 · lr=0.0001 nap=0.3 · PRUNED at step" in study_out
    html = next(o["data"]["text/html"] for o in nb.cells[4].outputs if "text/html" in o.get("data", {}))
    assert html.count("<svg") == 2 and "best val_loss" in html  # the study's best, the last trial's curve
    records = [json.loads(path.read_text()) for path in (tmp_path / "runs").glob("*/trial-5/result.json")]
    assert len(records) == 1 and records[0]["study"]["state"] == "PRUNED"


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", "") or output.get("data", {}).get("text/plain", ""))
        parts.extend(output.get("traceback", []))
    return "\n".join(parts)


# ---------------------------------------------------------------- concurrent trials


def test_gpus_per_trial_cuts_the_gpus_into_slots_as_a_batch_does_and_pins_each_worker(monkeypatch, tmp_path):
    """Several GPUs can't exist here: the count of visible GPUs is a fake (NVML's answer), the slots and each worker's
    command line and pinning are what a GPU machine gets."""
    from nbddp.contracts.errors import DeviceError
    from nbddp.doors.batch import schedule
    from nbddp.doors.tune.parallel import Tickets, trial_slots, workers
    from nbddp.plan.options import LaunchOptions

    monkeypatch.setattr(schedule, "visible_gpu_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5,6")
    assert trial_slots(LaunchOptions(), 2, None, print) == ([("3", "4"), ("5", "6")], "cuda")
    assert trial_slots(LaunchOptions(), 1, 3, print) == ([("3",), ("4",), ("5",)], "cuda")
    with pytest.raises(DeviceError, match=r"^--gpus-per-trial 5 asks for more GPUs"):
        trial_slots(LaunchOptions(), 5, None, print)
    with pytest.raises(UsageError, match="--gpus and --gpus-per-trial both"):
        trial_slots(LaunchOptions(gpus="2"), 2, None, print)
    made = workers(Path("nb.ipynb"), ("lr=uniform(0,1)",), LaunchOptions(), [("3", "4"), ("5", "6")], "cuda",
                   ["--trials", "4"], tmp_path / "tickets", 7)
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in made] == ["3,4", "5,6"]
    assert all(w.argv[w.argv.index("--gpus") + 1] == "2" for w in made)
    assert [w.argv[w.argv.index("--seed") + 1] for w in made] == ["8", "9"]
    tickets = Tickets(tmp_path / "tickets", 2)
    assert [tickets.take() for _ in range(3)] == [True, True, False]


@pytest.mark.slow
@pytest.mark.beside
def test_concurrent_trials_share_the_study_and_stop_when_the_study_process_is_killed(tmp_path, cli_run):
    _notebook(tmp_path / "tune.ipynb")
    args = _tune(tmp_path, "--space", "lr=loguniform(1e-3,0.5)", "--study-name", "c", "--pruner", "none",
                 "--parallel", "2", "-p", "epochs", "6", "-p", "nap", "0.2")
    args[args.index("--nproc") + 1] = "1"  # (two trials of one rank each: this machine's two cores)
    run = cli_run([*args, "--trials", "4"], tmp_path)
    assert run.wait(timeout=240) == 0, run.output
    assert "2 trials at once, each on 1 CPU process" in run.output
    storage = f"sqlite:///{tmp_path / 'runs' / 'c' / 'study.db'}"  # (the study's own, in its folder)
    trials = optuna.load_study(study_name="c", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4  # exactly --trials, taken by two workers
    spans = sorted((t.datetime_start, t.datetime_complete) for t in trials)
    assert any(a[1] > b[0] for a, b in zip(spans, spans[1:])), spans  # at once, not one after the other
    assert run.leftovers() == set()
    again = cli_run([*args, "--trials", "12"], tmp_path)  # the same study, resumed from its folder: 8 more
    wait_until(lambda: len(optuna.load_study(study_name="c", storage=storage).trials) >= 6, 120,
               "the resumed study's trials")
    os.kill(again.proc.pid, signal.SIGKILL)  # the study's process only: its workers see it gone and leave
    again.proc.wait()
    assert again.leftovers(grace=15) == set()


@pytest.mark.slow
@pytest.mark.beside
def test_the_example_notebook_finds_better_values_and_evaluates_the_best_trials_weights_on_the_cpu(tmp_path):
    import shutil
    import subprocess

    shutil.copy(Path(__file__).parent.parent / "notebooks" / "digits_tune.ipynb", tmp_path)
    done = subprocess.run([sys.executable, "-m", "papermill", "digits_tune.ipynb", "out.ipynb", "-p", "n_trials", "4",
                           "-p", "epochs", "3", "-k", "python3"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    texts = "\n".join(_text(cell) for cell in nbformat.read(tmp_path / "out.ipynb", as_version=4).cells)
    assert "trial 3 · lr=" in texts
    accuracy = float(texts.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.85, texts


def test_nbddp_tune_refuses_bad_input_before_anything_runs(tmp_path, monkeypatch):
    import nbddp

    _notebook(tmp_path / "tune.ipynb")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"^--space 'lr=logg\(1,2\)': unknown distribution 'logg'"):
        nbddp.tune("tune.ipynb", ["lr=logg(1,2)"], trials=1, cpu=True)
    with pytest.raises(UsageError, match="the search space gives lrr, which the training code doesn't read"):
        nbddp.tune("tune.ipynb", "lrr=uniform(0,1)", trials=1, cpu=True)
    with pytest.raises(UsageError, match="concurrent trials .* take the space as --space texts"):
        nbddp.tune("tune.ipynb", lambda t: {"lr": t.suggest_float("lr", 0.1, 1)}, trials=2, cpu=True, parallel=2)
    with pytest.raises(UsageError, match=r"^--storage nope\.db: give a database URL"):
        nbddp.tune("tune.ipynb", "lr=uniform(0,1)", trials=1, storage="nope.db")
    with pytest.raises(UsageError, match="drop --run-dir"):
        nbddp.tune("tune.ipynb", "lr=uniform(0,1)", trials=1, run_dir="x")
    optuna.create_study(study_name="up", storage="sqlite:///up.db", direction="maximize")
    with pytest.raises(UsageError, match=r"^study up in sqlite:///up\.db optimises maximize; this asks minimize"):
        nbddp.tune("tune.ipynb", "lr=uniform(0,1)", trials=1, storage="sqlite:///up.db", study_name="up", cpu=True)
    with pytest.raises(UsageError, match="^nbddp.objective runs a Jupyter kernel's training cell: call it in a kernel"):
        nbddp.objective(lambda t: {"lr": t.suggest_float("lr", 0.1, 1)})  # (no kernel here, no notebook given)
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.beside
def test_nbddp_tune_from_python_returns_the_study(tmp_path, monkeypatch, capsys):
    import nbddp

    _notebook(tmp_path / "tune.ipynb")
    monkeypatch.chdir(tmp_path)
    result = nbddp.tune("tune.ipynb", lambda t: {"hidden": t.suggest_int("hidden", 4, 8)}, trials=2, metric="val_loss",
                        pruner="none", seed=0, cpu=True, nproc=2, quiet=True)
    assert result.exit_code == 0 and [t.state.name for t in result.study.trials] == ["COMPLETE", "COMPLETE"]
    assert set(result.best_params) == {"hidden"} and [end.number for end in result.ends] == [0, 1]
    weights = nbddp.load_weights(result.study.best_trial.user_attrs["run_dir"])
    assert weights["model"]["0.weight"].shape[0] == result.best_params["hidden"]
    assert capsys.readouterr().out == ""  # (quiet: no table)
    with pytest.raises(UsageError, match=r"^the run never logged acc with nbddp.log \(it logged val_loss\): the study "
                                         r"stops here; name the metric its training logs \(val_loss\)$"):
        nbddp.tune("tune.ipynb", "lr=uniform(0.01,0.1)", trials=5, metric="acc", cpu=True, nproc=2, quiet=True)
