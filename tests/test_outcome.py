"""Judging a job's outcome: a pure function of the evidence, one row per branch."""

import signal
from pathlib import Path

import pytest

from nbddp.job.outcome import Evidence, Status, judge
from nbddp.job.record import RankError
from nbddp.contracts.rundir import RunDir

RUN = RunDir(Path("/runs/r1"))


def error(rank=1, type_="ValueError", message="bad value", time=1.0):
    return RankError(rank, type_, message, 3, 5, "nb.ipynb, cell 3, line 5", "x = f()", "Traceback...", time)


def evidence(**fields):
    base = dict(run_dir=RUN, notebook="nb.ipynb", launcher_exit=0, checkpoint_exists=True, nproc=2)
    return Evidence(**{**base, **fields})


ROWS = [
    # (row, evidence fields, status, exit code, blamed rank, words in the message)
    ("all ranks finished, weights written", {}, Status.SUCCEEDED, 0, None, ""),
    ("nbddp kill", {"stop_requested": True, "launcher_exit": -15}, Status.INTERRUPTED, 143, None,
     "stopped by `nbddp kill`"),
    ("a rank killed by SIGKILL", {"launcher_exit": 1, "rank_exit_codes": {1: -9, 0: -15}, "root_cause": 1},
     Status.FAILED, 1, 1, "rank 1 died: killed by SIGKILL"),
    ("the root cause wins over other signals", {"launcher_exit": 1, "rank_exit_codes": {0: -11, 1: -9}, "root_cause": 1},
     Status.FAILED, 1, 1, "rank 1 died: killed by SIGKILL"),
    ("finished, then crashed while exiting", {"launcher_exit": 1, "rank_exit_codes": {1: -6}, "done_ranks": frozenset({0, 1})},
     Status.FAILED, 1, 1, "rank 1 finished training, then crashed while exiting (SIGABRT)"),
    ("SIGTERMs to survivors are never the cause", {"launcher_exit": 1, "rank_exit_codes": {0: -15}, "errors": (error(),),
                                                   "checkpoint_exists": False},
     Status.FAILED, 1, 1, "rank 1 raised ValueError: bad value\n  at nb.ipynb, cell 3, line 5"),
    ("a rank gone early without a word", {"launcher_exit": -15, "stopped_by": signal.SIGTERM, "early_exit": 1},
     Status.FAILED, 1, 1, "rank 1 ended before the training finished, without an error"),
    ("a rank SIGKILLed, seen gone before torchrun reported it", {
        "launcher_exit": 1, "stopped_by": signal.SIGTERM, "early_exit": 1, "rank_exit_codes": {1: -9, 0: -15},
        "root_cause": 1, "checkpoint_exists": False}, Status.FAILED, 1, 1, "rank 1 died: killed by SIGKILL"),
    ("nbddp kill, while nbddp also stopped the launcher", {
        "stop_requested": True, "launcher_exit": -15, "stopped_by": signal.SIGTERM, "early_exit": 0},
     Status.INTERRUPTED, 143, None, "stopped by `nbddp kill`"),
    ("a peer vanished mid-collective, signal known", {"launcher_exit": 1, "rank_exit_codes": {1: -9},
                                                      "errors": (error(0, "RuntimeError", "Connection closed by peer"),)},
     Status.FAILED, 1, 1, "rank 1 died: killed by SIGKILL"),
    ("--timeout", {"launcher_exit": -15, "timed_out": True, "stopped_by": signal.SIGTERM}, Status.TIMEOUT, 124, None,
     "exceeded --timeout"),
    ("--idle-timeout", {"launcher_exit": -15, "timed_out": True, "idle_for": 4.0}, Status.TIMEOUT, 124, None,
     "no rank printed or logged anything for 4s (--idle-timeout)"),
    ("a collective timed out", {"launcher_exit": 1, "collective_timeout": 5.0, "checkpoint_exists": False,
                                "errors": (error(0, "DistBackendError", "Timed out waiting 5000ms for recv"),)},
     Status.TIMEOUT, 124, 0, "a collective timed out (--collective-timeout 5s): rank 0 waited"),
    ("Ctrl-C", {"launcher_exit": -2, "interrupted_by": signal.SIGINT, "stopped_by": signal.SIGINT}, Status.INTERRUPTED, 130,
     None, "interrupted by SIGINT"),
    ("SIGTERM to nbddp, even when Catalyst's children exit 0", {"stopped_by": signal.SIGTERM},
     Status.INTERRUPTED, 143, None, "interrupted by SIGTERM"),
    ("exit 0 without the weights", {"checkpoint_exists": False}, Status.FAILED, 1, None,
     "the ranks exited without saving the returned weights (weights.pt)"),
    ("the launcher failed before any rank", {"launcher_exit": 2, "checkpoint_exists": False,
                                             "launcher_tail": "usage: torchrun ...\nValueError: bad flag"},
     Status.FAILED, 1, None, "ValueError: bad flag\n\nthe launcher failed (exit code 2)"),
    ("unpicklable for Catalyst's spawn is bad input", {"launcher_exit": 1, "checkpoint_exists": False,
                                                       "launcher_tail": "nbddp.rank_side.catalyst_engine.UnpicklableError: x"},
     Status.FAILED, 2, None, "UnpicklableError: x"),
    ("a rank without a GPU of its own exits 3, as for devices", {
        "launcher_exit": 1, "rank_exit_codes": {1: 3, 0: -15}, "checkpoint_exists": False,
        "errors": (error(1, "DeviceError", "local rank 1 has no GPU: 2 processes were started on this machine"),)},
     Status.FAILED, 3, 1, "rank 1 raised DeviceError: local rank 1 has no GPU"),
    ("an error means failure even with weights", {"errors": (error(),)}, Status.FAILED, 1, 1, "rank 1 raised ValueError"),
    ("Slurm ended the job itself", {"launcher_exit": 1, "rank_exit_codes": {0: -15, 1: -15}, "checkpoint_exists": False,
                                    "scheduler_end": "Slurm stopped job 7 at its time limit (00:01:00)"},
     Status.FAILED, 1, None, "Slurm stopped job 7 at its time limit"),
    ("our own cancel of a Slurm job is an interruption", {
        "launcher_exit": 130, "interrupted_by": signal.SIGINT, "stopped_by": signal.SIGTERM,
        "scheduler_end": "Slurm: job 7 was cancelled"}, Status.INTERRUPTED, 130, None, "interrupted by SIGINT"),
    ("nodes that never met", {"launcher_exit": 1, "checkpoint_exists": False,
                              "rendezvous_failure": "only 1 of 2 nodes joined the rendezvous"},
     Status.FAILED, 1, None, "only 1 of 2 nodes joined"),
    ("a node went away", {"launcher_exit": 1, "checkpoint_exists": False, "node_gone": {
        "node": 1, "host": "b", "ranks": [2, 3], "run_dir": "/x"}, "errors": (error(0, "RuntimeError",
        "[../gloo/pair.cc:553] Connection closed by peer [10.0.0.2]:5506. This is typically caused by a crash"),)},
     Status.FAILED, 1, 0, "node 1 (b, ranks 2-3) went away while training: its ranks stopped answering (rank 0: "
                          "Connection closed by peer [10.0.0.2]:5506)"),
    ("node 1 and up succeed without the weights", {"checkpoint_exists": False, "checkpoint_expected": False,
                                                   "first_rank": 2}, Status.SUCCEEDED, 0, None, ""),
]


@pytest.mark.parametrize("row, fields, status, code, rank, words", ROWS, ids=[r[0] for r in ROWS])
def test_judge(row, fields, status, code, rank, words):
    outcome = judge(evidence(**fields))
    assert (outcome.status, outcome.exit_code, outcome.rank) == (status, code, rank), outcome.message
    assert words in outcome.message


def test_success_fills_in_every_rank_and_status_carries_its_exit_code():
    assert judge(evidence()).rank_exit_codes == {0: 0, 1: 0}
    assert judge(evidence(first_rank=2, checkpoint_expected=False)).rank_exit_codes == {2: 0, 3: 0}
    assert [s.exit_code for s in Status] == [0, 1, 124, 130] and str(Status.TIMEOUT) == "timeout"
    assert Status("failed") is Status.FAILED and Status.FAILED == "failed"


def test_the_exception_of_a_failed_run_carries_its_outcome_and_pickles():
    import pickle

    from nbddp.contracts.errors import RunFailed, RunInterrupted, RunTimeout
    from nbddp.job.outcome import run_error

    failed = run_error(judge(evidence(errors=(error(),), launcher_exit=1)), RUN)
    assert isinstance(failed, RunFailed) and failed.status == "failed" and failed.exit_code == 1
    assert (failed.rank, failed.exc_type, failed.cell, failed.line, failed.run_dir) == (1, "ValueError", 3, 5, "/runs/r1")
    again = pickle.loads(pickle.dumps(failed))
    assert type(again) is RunFailed and str(again) == str(failed) and again.__dict__ == failed.__dict__
    stopped = run_error(judge(evidence(interrupted_by=signal.SIGTERM, stopped_by=signal.SIGTERM)), RUN)
    assert isinstance(stopped, RunInterrupted) and stopped.exit_code == 143 and stopped.status == "interrupted"
    assert isinstance(run_error(judge(evidence(timed_out=True)), RUN), RunTimeout)


@pytest.mark.parametrize("fields, fresh", [
    ({"timed_out": True, "stopped_by": signal.SIGTERM, "launcher_exit": -15},
     "the run exceeded --timeout; every rank was stopped."),
    ({"interrupted_by": signal.SIGINT, "launcher_exit": -15}, "interrupted by SIGINT; every rank was stopped."),
    ({"stop_requested": True, "launcher_exit": -15}, "stopped by `nbddp kill`; every rank was stopped."),
])
def test_a_stop_says_what_it_did_to_the_ranks_warm_ones_only_leave_their_job(fields, fresh):
    assert judge(evidence(**fields)).message == fresh
    assert judge(evidence(**fields, warm=True)).message == fresh.replace("every rank was stopped",
                                                                         "every rank's job was stopped")


def test_the_ending_line_has_no_sentence_end_before_its_next_part():
    from nbddp.display.ending import Ending

    line = Ending(Status.TIMEOUT, 3.14, None, "no weights came back", "the run exceeded --timeout; every rank's job "
                  "was stopped.").line()
    assert line == ("timed out after 3.1s · the run exceeded --timeout; every rank's job was stopped · no weights came "
                    "back"), line
