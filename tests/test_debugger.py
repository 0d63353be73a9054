"""A rank's debugger relayed to the person running the job: pdb in the rank over a channel of files
(nbddp/rank_side/debugger.py, nbddp/contracts/debug_channel.py), its output shown and its prompts answered by the door
(nbddp/job/debugger.py): ``%ddp_debug``'s post-mortem on warm ranks, ``breakpoint()`` in training, ``nbddp run
--debug-on-failure``. The fast tests run the real pdb session in a thread of this process (a rank needs nothing
more than its channel); the slow ones drive real kernels (jupyter_client, answering the kernel's input requests as
a front end does) and real ranks."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from nbddp.contracts.debug_channel import DebugChannel, channels_under
from nbddp.job.debugger import Console, Relayed, relay, relay_open
from nbddp.rank_side import debugger
from tests.conftest import alive, wait_until
from tests.test_magic import ProtocolKernel


def _failing():
    def inner(values):
        doubled = [value * 2 for value in values]
        raise ValueError(f"bad {doubled}")
    inner([1, 2])


def _session_in_a_thread(folder: Path) -> tuple[threading.Thread, DebugChannel]:
    """A post-mortem of ``_failing``'s exception, as a rank runs it, in a thread (file, line of this file are
    'cell 9' of a notebook); the channel it opened in ``folder``."""
    try:
        _failing()
    except ValueError as exc:
        tb, headline = exc.__traceback__, f"ValueError: {exc}"
    here = os.path.abspath(__file__)
    where = lambda filename, line: f"nb.ipynb, cell 9, line {line}" if os.path.abspath(filename) == here else None  # noqa: E731
    thread = threading.Thread(target=debugger.post_mortem, args=(tb, folder, 1, "post-mortem", where, headline),
                              daemon=True)
    thread.start()
    return thread, wait_until(lambda: channels_under(folder), 60, "the post-mortem opened its channel", every=0.01)[0]


def _answering(answers: list[str], prompts: list[str]):
    def ask(prompt: str) -> str:
        prompts.append(prompt)
        return answers.pop(0)
    return ask


def test_a_relayed_post_mortem_reads_the_failing_frame_walks_up_and_names_notebook_lines(tmp_path):
    shown, prompts = [], []
    thread, channel = _session_in_a_thread(tmp_path / "debug")
    relay(channel, Console(_answering(["p doubled", "up", "p values", "where", "q"], prompts), shown.append),
          others_wait=False)
    thread.join(5)
    text = "".join(shown)
    assert not thread.is_alive() and channel.closed_mark.exists()
    assert prompts == ["(Pdb) "] * 5
    assert "rank 1's debugger: p EXPR" in text and "waiting for" not in text
    assert "ValueError: bad [2, 4]\n> " in text, text  # (the exception first)
    assert "-> raise ValueError" in text and "[nb.ipynb, cell 9, line" in text, text
    assert "[2, 4]" in text, text  # p doubled: the failing frame's local
    assert "inner([1, 2])" in text, text  # up: the frame that called it
    assert "*** NameError: name 'values' is not defined" in text, text  # (the caller has no `values`)


def test_stopping_the_cell_in_the_debugger_ends_the_session_and_goes_on(tmp_path):
    shown = []
    thread, channel = _session_in_a_thread(tmp_path / "debug")

    def interrupted(prompt: str) -> str:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        relay(channel, Console(interrupted, shown.append))
    thread.join(5)
    assert not thread.is_alive() and channel.quit_mark.exists() and channel.closed_mark.exists()


def test_a_front_end_that_answers_nothing_ends_the_session(tmp_path):
    shown = []
    thread, channel = _session_in_a_thread(tmp_path / "debug")

    def no_input(prompt: str) -> str:
        raise EOFError

    relay(channel, Console(no_input, shown.append))
    thread.join(5)
    assert not thread.is_alive()


def test_a_session_whose_rank_is_gone_is_left(tmp_path):
    channel = DebugChannel(tmp_path / "session")
    channel.open(0, "breakpoint")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    channel.session.write_text(f'{{"rank": 0, "pid": {dead.pid}, "why": "breakpoint"}}')
    started = time.monotonic()
    relay(channel, Console(lambda prompt: pytest.fail("nothing was asked"), lambda text: None))
    assert time.monotonic() - started < 5 and channel.quit_mark.exists()


def test_breakpoint_without_anyone_to_type_is_skipped_with_one_line(tmp_path, monkeypatch, capsys):
    """papermill, a batch, a detached run: NBDDP_DEBUGGER unset; PYTHONBREAKPOINT=0 and another rank's breakpoint: silent."""
    monkeypatch.setenv("NBDDP_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("NBDDP_DEBUGGER", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(debugger, "_skipped_in", set())
    debugger.breakpoint()
    debugger.breakpoint()
    out = capsys.readouterr().out
    assert out.count("breakpoint() skipped: nobody can type into a debugger here") == 1, out
    monkeypatch.setattr(debugger, "_skipped_in", set())
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")
    debugger.breakpoint()
    monkeypatch.delenv("PYTHONBREAKPOINT")
    monkeypatch.setenv("RANK", "1")
    debugger.breakpoint()  # (rank 0's by default)
    debugger.breakpoint(rank=0)
    assert capsys.readouterr().out == ""
    debugger.breakpoint(rank="all")
    assert "breakpoint() skipped" in capsys.readouterr().out
    assert not (tmp_path / "debug").exists()


class StdinKernel(ProtocolKernel):
    """A kernel whose input requests are answered, as JupyterLab's input box answers them."""

    def run(self, code: str, answers=(), cell_id: str | None = None, allow_stdin: bool = True) -> str:
        """What the cell printed, showed and raised, with each prompt and its answer (``q`` past the answers)."""
        content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": allow_stdin, "stop_on_error": True}
        msg = self.kc.session.msg("execute_request", content, metadata={"cellId": cell_id} if cell_id else {})
        self.kc.shell_channel.send(msg)
        answers, text = list(answers), []

        def idle() -> bool:
            """One round: a prompt answered, a message of the cell's read; ``True`` once the kernel is idle."""
            try:
                asked = self.kc.get_stdin_msg(timeout=0.01)
                answer = answers.pop(0) if answers else "q"
                text.append(f"<asked {asked['content']['prompt']!r}, answered {answer!r}>\n")
                self.kc.input(answer)
            except queue.Empty:
                pass
            try:
                reply = self.kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                return False
            if reply["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
                return False
            kind, found = reply["msg_type"], reply["content"]
            if kind == "stream":
                text.append(found["text"])
            elif kind == "error":
                text.append("\n".join(found["traceback"]))
            elif kind in ("display_data", "update_display_data"):
                text.append(found["data"].get("text/plain", ""))
            return kind == "status" and found["execution_state"] == "idle"

        wait_until(idle, self.timeout, "the cell ran to its end (the kernel idle)", every=0,
                   detail=lambda: "".join(text))
        return "".join(text)


SETUP = """#| ddp
import torch, nbddp
kept = torch.zeros(2)
def inner(batch):
    doubled = batch * 2
    raise ValueError('broke on ' + str(batch.tolist()))
"""
FAILING = """%%ddp_train --cpu --nproc 2
kept += 5
for step in range(3):
    batch = torch.full((2,), float(step + 10 * nbddp.rank()))
    if nbddp.rank() == 1 and step == 1:
        inner(batch)
    torch.distributed.barrier()
"""


@pytest.mark.slow
def test_ddp_debug_breakpoint_and_no_stdin_on_real_warm_ranks(tmp_path):
    """%ddp_debug after rank 1 fails: its frame's local, up to the cell's frame, the setup's object as the failure
    left it; --rank 0 (stopped in the barrier its peer left); the next run's state a fresh run's; breakpoint() on
    rank 0 while rank 1 waits in the barrier, `n`, `c` to a good end; without stdin, skipped."""
    kernel = StdinKernel(tmp_path, timeout=180)
    try:
        kernel.run("%load_ext nbddp")
        assert "no warm rank keeps a failure" in kernel.run("%ddp_debug")
        kernel.run(SETUP, cell_id="setup")
        failed = kernel.run(FAILING, cell_id="train")
        assert "rank 1 raised ValueError: broke on [11.0, 11.0]" in failed, failed
        assert "the last run's failure, kept for %ddp_debug: rank 1 (ValueError), rank 0 (" in kernel.run("%ddp_ranks")
        one = kernel.run("%ddp_debug", ["p doubled", "where", "up", "p step, batch, kept", "q"])
        assert "rank 1 (the first to fail): ValueError: broke on [11.0, 11.0]" in one, one
        assert "tensor([22., 22.])" in one, one  # the failing frame's local
        assert "-> raise ValueError('broke on ' + str(batch.tolist()))  [In [3], line 6]" in one, one
        assert "-> inner(batch)  [the %%ddp_train cell, line 6]" in one, one  # where / up: mapped to the cells
        assert "(1, tensor([11., 11.]), tensor([5., 5.]))" in one, one  # as the failure left them
        zero = kernel.run("%ddp_debug --rank 0", ["where", "q"])  # (failed in the barrier, or interrupted before it)
        assert "[nbddp] rank 0: " in zero and "  [the %%ddp_train cell, line " in zero, zero
        again = kernel.run("%%ddp_train --cpu --nproc 2\nprint('kept', kept.tolist(), nbddp.rank(), flush=True)", cell_id="train")
        assert "[rank 0] kept [0.0, 0.0] 0" in again and "on a warm rank" in again, again  # a fresh run's state
        assert "no warm rank keeps a failure" in kernel.run("%ddp_debug")  # (let go by the next run)
        stopped = kernel.run("%%ddp_train --cpu --nproc 2\nx = 41\nbreakpoint()\nx += 1\n"
                             "torch.distributed.barrier()\nprint('after', x, nbddp.rank(), flush=True)\n",
                             ["p x", "n", "p x", "c"], cell_id="train")
        assert "rank 0 stopped at breakpoint()" in stopped, stopped
        assert "rank 0's debugger (the other ranks are waiting for rank 0's debugger at their next collective)" \
            in stopped, stopped
        assert "-> x += 1  [the %%ddp_train cell, line 4]" in stopped, stopped
        assert stopped.index("\n41\n") < stopped.index("\n42\n") < stopped.index("[rank 1] after 42 1"), stopped
        assert "succeeded in" in stopped, stopped
        skipped = kernel.run("%%ddp_train --cpu --nproc 2\nbreakpoint()\nprint('went on', nbddp.rank(), flush=True)\n",
                             cell_id="train", allow_stdin=False)
        assert "breakpoint() skipped" in skipped and "[rank 1] went on 1" in skipped and "<asked" not in skipped, skipped
        assert "succeeded in" in skipped, skipped
    finally:
        kernel.close()


@pytest.mark.slow
def test_nbddp_run_debug_on_failure_opens_the_first_failing_ranks_frame_in_the_terminal(tmp_path):
    notebook = tmp_path / "fail.ipynb"
    nbformat.write(new_notebook(cells=[
        new_code_cell("#| ddp\nimport torch, nbddp"),
        new_code_cell("#| ddp-train\nfor step in range(3):\n    batch = torch.full((2,), float(step))\n"
                      "    if nbddp.rank() == 1 and step == 1:\n        raise ValueError('bad batch')\n"
                      "    torch.distributed.barrier()\n")]), notebook)
    proc = subprocess.run([sys.executable, "-m", "nbddp", "run", notebook.name, "--cpu", "--nproc", "2",
                           "--debug-on-failure"], input="p step, batch\nq\n", capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "[rank 1] [nbddp] rank 1 failed: its debugger is open where the run was started" in out, out
    assert "-> raise ValueError('bad batch')  [fail.ipynb, cell 2, line 5]" in out, out
    assert "(1, tensor([1., 1.]))" in out, out
    assert "rank 0 failed: its debugger" not in out, out  # (it failed because rank 1 ended: no session of its own)
    assert "rank 1 raised ValueError: bad batch" in out, out
    pids = [int(line.split("pid ")[1].rstrip(")")) for line in out.splitlines() if "started (pid" in line]
    assert len(pids) == 2 and not any(alive(pid) for pid in pids), out


def test_after_c_a_later_stop_opens_a_new_session_that_the_relay_finds(tmp_path, monkeypatch):
    """A breakpoint() in a loop: `c` ends each session (the rank runs on), the next stop opens another, which the
    relay finds as it found the first; one debugger for the job. (Stepping onto a breakpoint() line differs: 3.13's
    pdb stops before the call, 3.11's after it.)"""
    folder, seen = tmp_path / "debug", []
    monkeypatch.setenv("NBDDP_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("NBDDP_DEBUGGER", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(debugger, "_active", None)

    def rank_side():
        for step in range(3):
            debugger.breakpoint()
            seen.append(step)
        debugger.end_job()

    thread = threading.Thread(target=rank_side, daemon=True)
    thread.start()
    shown, prompts = [], []
    answers = ["p step", "c"] * 3
    sessions = Relayed(folder)

    def relayed_to_its_end() -> bool:
        if not thread.is_alive():
            return True
        relay_open(sessions, Console(_answering(answers, prompts), shown.append), thread.is_alive)
        return False

    wait_until(relayed_to_its_end, 60, "the rank's three breakpoints relayed, to its end", every=0.01,
               detail=lambda: "".join(shown))
    text = "".join(shown)
    assert not answers and seen == [0, 1, 2], text
    assert len(channels_under(folder)) == 3, text
    assert "\n0\n" in text and "\n1\n" in text and "\n2\n" in text, text
