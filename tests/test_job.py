"""Judging a job's outcome from what its processes did (real processes, no ranks needed)."""

from nbddp.contracts.devices import Devices
from nbddp.job.lifecycle import Job, JobSpec
from nbddp.notebook.script import Script
from nbddp.contracts.sourcemap import SourceMap
from nbddp.contracts.rundir import RunDir
from tests.conftest import alive


def test_stragglers_of_a_failed_launcher_are_reaped_without_calling_it_an_interruption(tmp_path):
    """A launcher that exits while a child of its group lingers: reaped, and the run is 'failed'."""
    text = ("import subprocess, sys\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "print('child', child.pid, flush=True)\n"
            "sys.exit(3)\n")
    script = Script(text, SourceMap("nb.ipynb", "train.py", ()), "catalyst", ())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with Job.start(JobSpec(script, Devices("cpu", 2), RunDir(run_dir), tmp_path)) as job:
        outcome = job.wait([])
    assert outcome.status == "failed" and outcome.exit_code == 1, outcome
    assert "the launcher failed (exit code 3)" in outcome.message
    child = int((run_dir / "logs" / "launcher.log").read_text().split("child ")[1].split()[0])
    assert not alive(child)
