"""``papermill --engine nbddp`` behaves as papermill's own engine on papermill's own test notebooks.

Each case runs both engines through papermill's command line (tests/papermill_parity.py). The full
matrix (every notebook, as published and with DDP cells) is docs/papermill.md, written by
``python -m tests.papermill_parity --markdown docs/papermill.md``; here, a case of each kind: the
notebook as published (which runs on papermill's own engine: it has no training cell) and, with a
DDP training cell appended, a run that succeeds, a cell that raises, ``sys.exit(1)``, a line-magic
error, ``--prepare-only``, a kernel cell's ``--execution-timeout`` and Ctrl-C. papermill's own engine's
side is its recorded result while the packages that decide it are the recorded versions
(``python -m tests.papermill_parity --record``), else it runs here too. (papermill's options
with a DDP notebook — ``--log-output``, ``--stdout-file``, ``--report-mode``, ``-`` — are tested in
tests/test_papermill_engine.py; their parity with papermill's engine is in the full matrix.)
"""

import pytest

from tests.papermill_parity import CASES, compare, recorded, run_case

pytestmark = pytest.mark.slow
BY_ID = {case.id: case for case in CASES}
WITH_DDP_CELLS = ("simple", "broken1", "sysexit1", "line-magic-error", "prepare-only", "kernel-cell-timeout",
                  "ctrl-c-in-a-kernel-cell")


@pytest.mark.parametrize("case_id, variant", [("simple", "published"), ("broken", "published"),
                                              *((case, "ddp") for case in WITH_DDP_CELLS)])
def test_the_nbddp_engine_behaves_as_papermills_own(case_id, variant, tmp_path):
    case = BY_ID[case_id]
    reference = recorded(case, variant) or run_case(case, variant, "papermill", tmp_path / "papermill")
    ours = run_case(case, variant, "nbddp", tmp_path / "nbddp")
    assert compare(reference, ours) == [], (reference.get("stderr_tail", "(recorded)"), ours["stderr_tail"])
    if variant == "ddp" and any(c["ddp"] and "trained" in c["text"] for c in ours.get("cells", [])):
        assert list((tmp_path / "nbddp").rglob("runs/*/weights.pt")), "the training cell didn't run as a DDP job"
        assert "[rank 1]" in next(c["text"] for c in ours["cells"] if c["ddp"] and "trained" in c["text"])


def test_an_exception_pyzmq_only_logged_is_not_what_the_run_ended_with():
    """papermill's own engine, under load, can log pyzmq's shutdown race and still exit 0 (seen in CI)."""
    from tests.papermill_parity import _exception

    logged = ("Executing notebook with kernel: python3\nERROR:tornado.general:Uncaught exception in ZMQStream "
              "callback\nTraceback (most recent call last):\n  File \"zmqstream.py\", line 1, in _handle_recv\n"
              "    msg = self.socket.recv_multipart(zmq.NOBLOCK)\nzmq.error.ZMQError: not a socket\n")
    assert _exception(logged) == ""
    raised = logged + "Traceback (most recent call last):\n  File \"x\"\npapermill.exceptions.PapermillExecutionError: x\n"
    assert _exception(raised) == "PapermillExecutionError"
