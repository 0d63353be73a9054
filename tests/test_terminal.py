"""What `nbddp run` prints: rank lines, and on a terminal tqdm's epoch bar; metrics are never echoed as lines."""

import os
import re
import select
import subprocess
import sys
import time

import pytest

from nbddp.job.follow import LogLine, MetricsEvent
from nbddp.display.terminal import NotebookOutputSink, TerminalSink
from tests.conftest import code, kill_group, wait_until, write_notebook


def test_without_a_terminal_only_what_the_ranks_printed_is_shown():
    lines = []
    sink = TerminalSink(lines.append, tty=False)
    sink(LogLine(1, "hello"))
    sink(MetricsEvent({"epoch": 1, "epochs": 3, "loss": 0.25, "time": 1.0}))  # the rank prints its own line
    sink(LogLine(0, "same everywhere", every_rank=True))
    sink.close()
    assert lines == ["[rank 1] hello\n", "[all ranks] same everywhere\n"]


def test_on_a_terminal_epochs_drive_a_progress_bar_under_the_lines(capsys):
    lines = []
    sink = TerminalSink(lines.append, tty=True)
    sink(MetricsEvent({"epoch": 1, "epochs": 3, "loss": 0.5}))
    sink(LogLine(0, "between"))
    sink(MetricsEvent({"epoch": 3, "epochs": 3, "loss": 0.125}))
    assert (sink.bar.n, sink.bar.total) == (3, 3) and lines == ["[rank 0] between\n"]
    sink.close()
    shown = capsys.readouterr().out
    assert "3/3" in shown and "loss=0.125" in shown and "epoch" in shown
    sink(MetricsEvent({"step": 5, "loss": 0.1}))  # no epoch count: no bar, no echo
    sink(MetricsEvent({"epoch": "3/10", "epochs": 10}))  # not a count: ignored, never a crash
    assert lines == ["[rank 0] between\n"]
    sink(MetricsEvent({"epoch": 1.5, "epochs": 4.0, "loss": 0.2}))  # the Hugging Face Trainer's fractions
    assert (sink.bar.n, sink.bar.total) == (1.5, 4.0)
    sink.close()


def test_progress_bars_of_ranks_are_thinned_and_kept_out_of_the_notebook(tmp_path):
    lines = []
    sink = TerminalSink(lines.append, tty=False)
    for _ in range(5):
        sink(LogLine(0, "50%|#####", progress=True))
    assert lines == ["[rank 0] 50%|#####\n"]
    notebook = NotebookOutputSink(tmp_path, limit=2)
    for text in ("a", "b", "c"):
        notebook(LogLine(0, text))
    notebook(LogLine(0, "bar", progress=True))
    (output,) = notebook.outputs()
    assert output["text"].startswith("[rank 0] a\n[rank 0] b\n[nbddp] 1 more lines not shown")


def in_a_pty(argv, cwd, timeout=240, columns=100) -> bytes:
    """Every byte ``argv`` writes to a real terminal (a pty of ``columns`` columns) until it exits."""
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(argv, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                            env={**os.environ, "TERM": "xterm"})
    os.close(slave)
    received, started = b"", time.monotonic()

    def closed() -> bool:
        """What the terminal shows read, a second's worth at most; ``True`` once no process holds it."""
        nonlocal received
        if select.select([master], [], [], 1.0)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every process holding the terminal has gone
                return True
            if not chunk:
                return True
            received += chunk
        return False

    try:
        wait_until(closed, timeout, f"{argv[2:]} ended, its terminal closed", every=0,
                   detail=lambda: received.decode(errors="replace")[-3000:])
        assert proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started))) == 0, received.decode(errors="replace")
    finally:
        kill_group(proc.pid)
        os.close(master)
    return received


def screen(text: str) -> list[str]:
    """What a terminal shows for ``text``: each ``\\r`` returns to the line's start, later characters overwrite."""
    lines, line, column = [], [], 0
    for char in text:
        if char == "\r":
            column = 0
        elif char == "\n":
            lines.append("".join(line).rstrip())
            line, column = [], 0
        else:
            line[column:column + 1] = [char]
            column += 1
    return [*lines, "".join(line).rstrip()] if line else lines


@pytest.mark.slow
def test_on_a_real_terminal_the_bar_ends_once_and_the_ending_has_a_line_of_its_own(tmp_path):
    write_notebook(tmp_path / "tiny.ipynb", [
        code("#| ddp\nimport time\nimport torch\nimport nbddp\nmodel = torch.nn.Linear(2, 1)"),
        code("#| ddp-train\nnbddp.prepare(model)\nfor epoch in range(1, 5):\n    time.sleep(0.4)\n"
             "    nbddp.log(epoch=epoch, epochs=4, loss=2.441)\nprint('trained')"),
    ])
    text = in_a_pty([sys.executable, "-m", "nbddp", "run", "tiny.ipynb", "--cpu"], tmp_path).decode()
    ending = text.index("nbddp: succeeded in")
    before, after = text[:ending], text[ending:]
    assert before.endswith("\r\n"), repr(before[-200:])  # the ending starts a line: never glued to the bar
    assert "%|" not in after and "epoch/s" not in after, repr(after)  # no bar redrawn after the ending
    assert len(re.findall(r"epoch/s[^\r\n]*\]\r\n", text)) == 1, repr(text)  # the bar was closed once
    shown = screen(text)
    assert re.match(r"^100%\|.*\| 4/4 \[.*loss=2\.441\]$", shown[-3]), shown  # the bar, finished, stays
    assert shown[-2].startswith("nbddp: succeeded in") and shown[-1].startswith("nbddp: final metrics: loss=2.441")
    assert "[rank 0] trained" in shown and "[rank 1] trained" in shown, shown  # lines went above the bar
    assert not any("%|" in line for line in shown[:-3]), shown  # the bar was never left among them


# ---------------------------------------------------------------- terminal-safe output (what a rank's text can do)

#: A rank's line that would set the window's title, write the clipboard (OSC 52), clear the screen and move the
#: cursor, between a coloured word and a progress bar's carriage return.
HOSTILE_LINE = ("\x1b[31mred\x1b[0m \x1b]0;pwned\x07 \x1b]52;c;ZWNobyBwd25lZA==\x07 \x1b[2J\x1b[H \x9b1A "
                "\u202eevil 50%\r60%")
SHOWN = ("\x1b[31mred\x1b[0m \\x1b]0;pwned\\x07 \\x1b]52;c;ZWNobyBwd25lZA==\\x07 \\x1b[2J\\x1b[H \\x9b1A "
         "\\u202eevil 50%\r60%")


def test_a_ranks_control_sequences_are_shown_escaped_colours_and_carriage_returns_pass():
    """(Through the real door: tests/test_shared_machine.py's run on one machine, whose rank prints such a line.)"""
    lines, said = [], []
    sink = TerminalSink(lines.append, tty=False)
    sink(LogLine(0, HOSTILE_LINE))
    sink.above(said.append)(f"error: rank 0 raised ValueError: {HOSTILE_LINE}")
    assert lines == [f"[rank 0] {SHOWN}\n"] and said == [f"error: rank 0 raised ValueError: {SHOWN}"]
    raw_lines, raw_said = [], []
    raw = TerminalSink(raw_lines.append, tty=False, raw=True)  # nbddp run --raw-output
    raw(LogLine(0, HOSTILE_LINE))
    raw.above(raw_said.append)(HOSTILE_LINE)
    assert raw_lines == [f"[rank 0] {HOSTILE_LINE}\n"] and raw_said == [HOSTILE_LINE]
