"""The launcher seam: commands, and reading each launcher's own failure report."""

from pathlib import Path

from nbddp.devices import Devices
from nbddp.launchers import launcher_for
from nbddp.rundir import RunDir

TORCHRUN = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_02:00:00
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_02:00:00
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4241)
"""


def test_torchrun_command_keeps_its_folder_in_the_run_dir():
    torchrun = launcher_for("torch")
    argv = torchrun.command(Path("/r/train.py"), Devices("cpu", 3), RunDir(Path("/r")), python="py", max_restarts=2)
    assert argv[:3] == ["py", "-m", "torch.distributed.run"] and argv[-1] == "/r/train.py"
    assert {"--standalone", "--nproc-per-node=3", "--max-restarts=2", "--log-dir=/r/logs/torchrun"} <= set(argv)
    assert torchrun.supports_restarts and not torchrun.streams_launcher_log


def test_torchrun_report_and_root_cause():
    torchrun = launcher_for("torch")
    assert torchrun.rank_exit_codes(TORCHRUN) == {1: -9, 0: 1}
    assert torchrun.root_cause(TORCHRUN) == 0 and torchrun.root_cause("nothing here") is None


def test_catalyst_spawn_runs_the_script_and_reads_mp_spawn_reports():
    spawn = launcher_for("catalyst")
    assert spawn.command(Path("/r/train.py"), Devices("cpu", 2), RunDir(Path("/r")), python="py") == ["py", "/r/train.py"]
    assert not spawn.supports_restarts and spawn.streams_launcher_log
    report = ("torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGKILL\n"
              "-- Process 0 terminated with the following error:\n")
    assert spawn.rank_exit_codes(report) == {1: -9, 0: 1} and spawn.root_cause(report) is None
