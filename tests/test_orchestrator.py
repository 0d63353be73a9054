"""One path for every run: every front door's job goes through the orchestrator and the launcher seam.

A spy launcher is registered at the seam the way another package would register one: an
``nbddp.launchers`` entry point in a distribution on ``sys.path`` (a fake dist-info the test writes,
reaching every process through ``PYTHONPATH``). It replaces the built-in ``direct`` and ``warm``
launchers by subclasses that record each job they start, and whether the orchestrator asked for
it, then launch as usual. Real doors, real kernels, real ranks (2 gloo processes): this is the fast
tier's real-process test of ``nbddp run``, ``nbddp.run()``, ``%%ddp_train``, ``nbddp batch`` and
``papermill --engine nbddp``.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import code, write_notebook
from tests.linear_fit import EVALUATE, SETUP, assert_matches, train_cell
from tests.plugin_site import plugin_environment

SPY = '''
import json, os, traceback
from nbddp.launchers.direct import Direct
from nbddp.launchers.warm.launcher import WarmRanks


def _seen(spec, launcher):
    stack = [frame.filename.replace(os.sep, "/") for frame in traceback.extract_stack()]
    with open(os.environ["NBDDP_SPY_LOG"], "a") as log:
        log.write(json.dumps({"launcher": launcher, "run_dir": str(spec.run_dir), "pid": os.getpid(),
                              "orchestrated": any(f.endswith("nbddp/job/orchestrator.py") for f in stack)}) + "\\n")


class SpyDirect(Direct):
    @classmethod
    def for_job(cls, spec):
        _seen(spec, "direct")
        return super().for_job(spec)


class SpyWarm(WarmRanks):
    @classmethod
    def for_job(cls, spec):
        _seen(spec, "warm")
        return super().for_job(spec)
'''


@pytest.fixture
def spy(tmp_path):
    """``(env, seen)``: the environment every door runs with, and what the spy recorded so far."""
    log = tmp_path / "spy.jsonl"
    env = {**plugin_environment(tmp_path / "site", "nbddp_spy", SPY, {
        "nbddp.launchers": {"direct": "nbddp_spy:SpyDirect", "warm": "nbddp_spy:SpyWarm"}}), "NBDDP_SPY_LOG": str(log)}

    def seen() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return env, seen


def _run(argv: list[str], cwd: Path, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.beside  # long, asserts no timing: runs beside the rest in .ci/run, where the lanes even out
def test_every_front_door_runs_through_the_orchestrator_and_the_launcher_seam(tmp_path, spy):
    env, seen = spy
    # A `#| parameters` directive (papermill alone finds its cell by tag): every door's `batch 8` must reach
    # the ranks (2 ranks x 8 = one process with 16); the default 4 would train differently.
    write_notebook(tmp_path / "fit.ipynb", [code("#| parameters\nbatch = 4"), code(SETUP),
                                             code(train_cell(8).replace("batch_size=8", "batch_size=batch")),
                                             code(EVALUATE)])
    doors = {}

    _run([sys.executable, "-m", "nbddp", "run", "fit.ipynb", "--cpu", "--nproc", "2", "-p", "batch", "8"], tmp_path,
         env)
    doors["nbddp run"] = seen()[-1]

    api = ("import nbddp\nresult = nbddp.run('fit.ipynb', parameters={'batch': 8}, cpu=True, nproc=2, quiet=True)\n"
           "result.raise_for_status(); print('API', result.status, result.run_dir)")
    assert "API succeeded" in _run([sys.executable, "-c", api], tmp_path, env).stdout
    doors["nbddp.run()"] = seen()[-1]

    (tmp_path / "grid.yaml").write_text("batch: [8]\n")
    _run([sys.executable, "-m", "nbddp", "batch", "fit.ipynb", "--grid", "grid.yaml", "--cpu", "--nproc", "2",
          "--out", "sweep"], tmp_path, env)
    doors["nbddp batch"] = seen()[-1]

    papermill = _run([sys.executable, "-m", "papermill", "--engine", "nbddp", "fit.ipynb", "out.ipynb", "-p", "batch",
                      "8"], tmp_path, {**env, "NBDDP_OPTIONS": "--cpu --nproc 2"})
    assert "Passed unknown parameter" not in papermill.stderr and "does not contain a cell" not in papermill.stderr
    doors["papermill --engine nbddp"] = seen()[-1]
    for door in ("nbddp run", "nbddp.run()", "nbddp batch", "papermill --engine nbddp"):
        assert_matches(Path(doors[door]["run_dir"]) / "weights.pt", batch=16)

    magic = tmp_path / "magic.ipynb"
    write_notebook(magic, [code("%load_ext nbddp"), code(SETUP),
                           code("%%ddp_train --cpu --nproc 2\n" + train_cell(8).split("\n", 1)[1]), code(EVALUATE)])
    _run([sys.executable, "-m", "jupyter", "execute", "--inplace", str(magic)], tmp_path, env)
    doors["%%ddp_train"] = seen()[-1]

    assert len({door["run_dir"] for door in doors.values()}) == len(doors)  # one job each, each seen
    for name, door in doors.items():
        assert door["orchestrated"], f"{name}: the launcher was not asked by the orchestrator"
        result = json.loads((Path(door["run_dir"]) / "result.json").read_text())
        assert result["status"] == "succeeded", (name, result)
    assert doors["%%ddp_train"]["launcher"] == "warm" and doors["nbddp batch"]["launcher"] == "warm"
    assert doors["nbddp run"]["launcher"] == doors["papermill --engine nbddp"]["launcher"] == "direct"


def test_nbddp_run_takes_every_launch_option_as_a_typed_keyword():
    """``nbddp.run`` and ``nbddp.batch`` name each option (no ``**kwargs``); none of LaunchOptions is missing."""
    from dataclasses import fields

    import nbddp
    from nbddp.plan.options import LaunchOptions

    options = {f.name for f in fields(LaunchOptions)}
    for function, not_there in ((nbddp.run, set()), (nbddp.batch, {"run_dir", "nodes", "rdzv_timeout", "wait"})):
        signature = inspect.signature(function)
        assert not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        assert options - not_there <= set(signature.parameters), options - set(signature.parameters)
        assert all(p.annotation is not p.empty for p in signature.parameters.values())


# ---------------------------------------------------------------- how a run's ending is concluded (no processes)

from nbddp.contracts.errors import CheckpointError, RunFailed, RunInterrupted, RunTimeout  # noqa: E402
from nbddp.job.orchestrator import KernelResult, RunResult, _conclude  # noqa: E402
from nbddp.job.outcome import JobOutcome  # noqa: E402
from nbddp.contracts.status import Status  # noqa: E402


def _result(job: Status, kernel: KernelResult, interrupted_by=None) -> RunResult:
    outcome = JobOutcome(job, job.exit_code, 0 if job is Status.SUCCEEDED else 1,
                         message="" if job is Status.SUCCEEDED else f"the job {job}", rank=1)
    return RunResult(Status.FAILED, 1, Path("/r"), outcome=outcome, kernel=kernel, interrupted_by=interrupted_by)


@pytest.mark.parametrize("job, kernel, trained, interrupted_by, status, code, error", [
    (Status.SUCCEEDED, KernelResult(loaded=["model"]), True, None, Status.SUCCEEDED, 0, None),
    (Status.FAILED, KernelResult(), True, None, Status.FAILED, 1, RunFailed),  # a rank raised
    (Status.TIMEOUT, KernelResult(), True, None, Status.TIMEOUT, 124, RunTimeout),  # --timeout in training
    # a kernel cell failed before the training: the job was stopped for it (its own outcome: interrupted)
    (Status.INTERRUPTED, KernelResult.failed("cell 2 raised"), False, None, Status.FAILED, 1, RunFailed),
    (Status.INTERRUPTED, KernelResult.failed("--timeout", Status.TIMEOUT), False, None, Status.TIMEOUT, 124, RunTimeout),
    # the weights couldn't be loaded, or a cell after the training failed
    (Status.SUCCEEDED, KernelResult.failed("no fit", error=CheckpointError("no fit")), True, None, Status.FAILED, 1,
     CheckpointError),
    (Status.INTERRUPTED, KernelResult(), False, 2, Status.INTERRUPTED, 130, RunInterrupted),  # Ctrl-C
    (Status.INTERRUPTED, KernelResult(), False, 15, Status.INTERRUPTED, 143, RunInterrupted),  # SIGTERM to nbddp run
    (Status.SUCCEEDED, KernelResult(), True, 2, Status.INTERRUPTED, 130, RunInterrupted),  # Ctrl-C in evaluation
])
def test_the_runs_ending_comes_from_what_ended_it_first(job, kernel, trained, interrupted_by, status, code, error):
    result = _result(job, kernel, interrupted_by)
    _conclude(result, trained)
    assert (result.status, result.exit_code) == (status, code)
    raised = result.error()
    assert (raised is None) if error is None else type(raised) is error, raised
    if error is RunFailed and job is Status.FAILED:
        assert raised.rank == 1  # the judged outcome travels with it


def test_a_fact_of_the_machine_is_said_once_per_kernel_and_every_time_elsewhere():
    """``no GPU visible: running on the CPU…`` came with every ``%%ddp_train`` cell; a kernel's door remembers it."""
    from nbddp.job.orchestrator import _news

    fact = "no GPU visible: running on the CPU with 2 processes (gloo)."
    kernel: set[str] = set()
    assert _news([fact], kernel) == [fact] and _news([fact], kernel) == [] and _news([], kernel) == []
    assert _news([fact], None) == _news([fact], None) == [fact]  # (nbddp run: one run, one line)
