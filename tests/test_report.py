"""Describing exits (launchers' own reports: tests/test_launchers.py)."""

from nbddp.job.record import describe_exit



def test_describe_exit():
    assert "SIGKILL" in describe_exit(-9) and "out-of-memory" in describe_exit(-9)
    assert "SIGSEGV" in describe_exit(-11)
    assert describe_exit(3) == "exit code 3"
