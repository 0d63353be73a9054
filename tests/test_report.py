"""Reading launcher failure reports and describing exits."""

from nbddp.report import describe_exit, launcher_exit_codes

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


def test_torchrun_report(tmp_path):
    (tmp_path / "l.log").write_text(TORCHRUN)
    assert launcher_exit_codes(tmp_path / "l.log") == {1: -9, 0: 1}


def test_mp_spawn_reports(tmp_path):
    (tmp_path / "l.log").write_text(
        "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGKILL\n"
        "-- Process 0 terminated with the following error:\n"
    )
    assert launcher_exit_codes(tmp_path / "l.log") == {1: -9, 0: 1}


def test_describe_exit():
    assert "SIGKILL" in describe_exit(-9) and "out-of-memory" in describe_exit(-9)
    assert "SIGSEGV" in describe_exit(-11)
    assert describe_exit(3) == "exit code 3"


def test_torchrun_root_cause(tmp_path):
    from nbddp.report import launcher_root_cause

    (tmp_path / "l.log").write_text(TORCHRUN)
    assert launcher_root_cause(tmp_path / "l.log") == 0
    (tmp_path / "m.log").write_text("nothing here")
    assert launcher_root_cause(tmp_path / "m.log") is None
