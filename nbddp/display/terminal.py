"""Where rank output goes outside Jupyter: the terminal of ``nbddp run`` and its executed notebook."""

from __future__ import annotations

import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from nbddp.job.follow import Event, LogLine, MetricsEvent, rank_prefix
from nbddp.contracts.metrics import format_metrics, measures

#: Training-cell output kept in the executed notebook; the full logs stay in the run dir.
NOTEBOOK_OUTPUT_LINES = 2000


def stdout_write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


#: What a terminal shows as it is: colours and styles (SGR, ``ESC [ … m``), or any character but the controls below.
_SGR = r"\x1b\[[0-9;:]*m"
#: What a terminal would obey rather than show: C0 controls but the tab, line feed and carriage return (a progress
#: bar redrawn in place), DEL, C1 controls (``\x9b`` is a CSI too) and the bidirectional controls, which reorder
#: what follows them.
_CONTROL = "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]"
_SHOWN_OR_NOT = re.compile(f"({_SGR})|{_CONTROL}")


def terminal_safe(text: str) -> str:
    """``text`` as the terminal should show it, whatever a rank or a dataset put in it: printable text, tabs, line
    feeds, carriage returns and colours pass; every other control character is shown escaped (``\\x1b]52;…``), so no
    escape sequence in a rank's output or an error's message sets the window's title, writes the clipboard (OSC 52),
    moves the cursor or clears the screen. (``nbddp run --raw-output`` passes everything as it is.)"""
    return _SHOWN_OR_NOT.sub(lambda found: found.group(1) or found.group().encode("unicode_escape").decode("ascii"),
                             text)


def _count(value: object) -> bool:
    """An epoch count: a whole number, or a fraction (the Hugging Face Trainer logs ``epoch=1.5``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TerminalSink:
    """Rank output as ``[rank N] line``. Metrics that count epochs (``nbddp.log(epoch=..., epochs=...)``)
    become tqdm's epoch bar under the lines on a terminal; they are never echoed as lines (the ranks
    print what they want seen; every record is in ``metrics.jsonl``, the last one in the ending).

    The bar is the terminal's last line while the run goes: everything else written to the terminal
    meanwhile goes above it (:meth:`line`, and nbddp's own lines through :meth:`above`), and the door
    closes it (:meth:`close`) before the ending, which then starts on a line of its own with no bar after it.
    """

    def __init__(self, write: Callable[[str], Any] = stdout_write, tty: bool | None = None, raw: bool = False) -> None:
        self.write = write
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.shown: Callable[[str], str] = (lambda text: text) if raw else terminal_safe
        """What reaches the terminal of a line: :func:`terminal_safe`'s, or as it is (``--raw-output``)."""
        self.bar = None
        self.last_progress: dict[int | None, float] = {}

    def __call__(self, event: Event) -> None:
        if isinstance(event, LogLine):
            if event.progress:  # a redrawn progress bar: at most one line a second per rank
                now = time.monotonic()
                if now - self.last_progress.get(event.rank, 0.0) < 1.0:
                    return
                self.last_progress[event.rank] = now
            self.line(f"{rank_prefix(event.rank, event.every_rank)}{event.text}\n")
        elif isinstance(event, MetricsEvent):
            epoch, epochs = event.values.get("epoch"), event.values.get("epochs")
            if self.tty and _count(epochs) and _count(epoch) and 0 <= epoch <= epochs:
                self._epoch_bar(event.values)

    def line(self, text: str) -> None:
        """Write ``text`` above the epoch bar (the bar stays under the newest line)."""
        with self._above_bar():
            self.write(self.shown(text))

    def above(self, say: Callable[[str], Any]) -> Callable[[str], None]:
        """``say`` (nbddp's own lines, on stderr) writing above the epoch bar, as :meth:`line` does."""

        def said(text: str) -> None:
            with self._above_bar():
                say(self.shown(text))

        return said

    @contextmanager
    def _above_bar(self) -> Iterator[None]:
        if self.bar is not None:
            self.bar.clear()
            self.bar.fp.flush()  # the bar's stdout before a line on stderr: both reach the same terminal
        yield
        if self.bar is not None:
            self.bar.refresh()

    def _epoch_bar(self, values: dict) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=values["epochs"], unit="epoch", file=sys.stdout, dynamic_ncols=True)
        self.bar.set_postfix_str(format_metrics(measures(values)), refresh=False)
        self.bar.update(round(values["epoch"] - self.bar.n, 6))

    def close(self) -> None:
        """End the epoch bar where it stands, on a line of its own (once: closing again does nothing)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class NotebookOutputSink:
    """Rank output as the training cell's stdout: one stream output that grows as lines come, capped.

    ``on_lines(text)`` is told each line added (papermill logs them live and saves the notebook).
    """

    def __init__(self, run_dir: Path | None = None, limit: int = NOTEBOOK_OUTPUT_LINES) -> None:
        from nbformat.v4 import new_output

        self.output = new_output("stream", name="stdout", text="")
        self.limit = limit
        self.count = 0
        self.dropped = 0
        self.run_dir = run_dir
        self.on_lines: Callable[[str], Any] | None = None

    def __call__(self, event: Event) -> None:
        if isinstance(event, LogLine) and not event.progress:
            if self.count < self.limit:
                line = f"{rank_prefix(event.rank, event.every_rank)}{event.text}\n"
                self.output.text += line
                self.count += 1
                if self.on_lines is not None:
                    self.on_lines(line)
            else:
                self.dropped += 1

    def outputs(self) -> list[dict]:
        """The cell's output so far (the growing node itself), with a last line saying how many were left out."""
        from nbformat.v4 import new_output

        if not self.dropped:
            return [self.output] if self.output.text else []
        where = Path(self.run_dir) / "logs" if self.run_dir else "the run dir's logs"
        trailer = f"[nbddp] {self.dropped} more lines not shown: full logs in {where}\n"
        return [new_output("stream", name="stdout", text=self.output.text + trailer)]
