"""What a running ``%%ddp_train`` cell shows: ipywidgets where they render, text elsewhere.

The widget view is displayed once and then only its widgets' values change (never the output
itself), so the front end keeps its DOM: a reader's scroll position and selection in a log pane
survive new lines, which arrive as new chunks appended below the old ones. The status line and
the plot are redrawn together, from the same metrics record, so they never disagree.

When the run ends, however it ends, the output is replaced (``update_display``) by a static copy
(:mod:`nbddp.doors.jupyter.snapshot`) that renders without a kernel: after a reload, in nbviewer or on
GitHub. Should the kernel restart mid-run, the page's widget manager marks the view disconnected,
and a CSS rule in the view turns its status line into a note saying so (no JavaScript needed).

Front ends that don't render widgets (nbclient, papermill, ``jupyter console``, ``jupyter
execute``) get every rank's lines as text while the cell runs (:class:`TextMirror`): new outputs
whose ``text/plain`` holds the lines and whose ``text/html`` is empty, so a front end that renders
HTML shows nothing there. Where the request came from JupyterLab or Notebook 7, which render the
widgets, no mirror is sent at all (:func:`front_end_renders_widgets`). A terminal IPython, which
can't update a display, gets lines printed as they come. Updates happen in the thread running the
cell (ipykernel's output from other threads changed across versions).

Lines are shown at once, up to ``BURST_REFRESHES`` updates in a row; while the ranks keep printing,
their lines are gathered into at most ``1 / REFRESH_SECONDS`` updates a second (a token bucket).
A run's own start lines ("rank 0/2 started …") come just before the user's first line, so a plain
"after a quiet moment" rule held that first line back a whole refresh.
"""

from __future__ import annotations

import html
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

from nbddp.display.ending import Ending, shown_path
from nbddp.doors.jupyter.snapshot import snapshot_html, snapshot_text
from nbddp.display.metric_plot import svg_plot
from nbddp.job.follow import Event, LogLine, MemoryEvent, MetricsEvent, rank_prefix
from nbddp.contracts.rank_memory import describe as describe_memory
from nbddp.contracts.metrics import curves, format_metrics

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
REFRESH_SECONDS = 0.25
#: Updates carrying lines that may follow each other at once, before lines wait for the next refresh.
BURST_REFRESHES = 4
KEEP_LINES = 400
PANE_HEIGHT_PX = 240
#: A pane's lines arrive as chunks (one per refresh that had new lines). Past this many, the pane
#: is rebuilt as one chunk of its last KEEP_LINES lines: rare, and bounding what the page holds.
MAX_CHUNKS = 400
#: A chunk holds at most this many lines: a burst of 100k lines in one refresh shows its last ones
#: under a line saying how many were skipped (the run dir's logs have every line), so the page and
#: the widget messages stay small however fast a rank prints.
CHUNK_LINES = KEEP_LINES

#: The view's own CSS, scoped to it. ipywidgets adds ``jupyter-widgets-disconnected`` to every
#: widget of a kernel that restarted: then the status says so and the bar turns grey.
_STYLE = """<style>
.nbddp-view .nbddp-gone{display:none}
.nbddp-view.jupyter-widgets-disconnected .nbddp-gone{display:inline;color:#b00020}
.nbddp-view.jupyter-widgets-disconnected .nbddp-live{display:none}
.nbddp-view.jupyter-widgets-disconnected .progress-bar{background-color:#9e9e9e !important}
.nbddp-view pre.nbddp-lines{margin:0;padding:0 4px;line-height:1.35;font-size:12px;white-space:pre}
</style>"""


class TextView:
    """Plain text: each line printed as it arrives (terminal IPython, plain Python)."""

    def __init__(self, write: Callable[[str], Any] = print) -> None:
        self.write = write

    def __call__(self, event: Event) -> None:
        if isinstance(event, LogLine) and not event.progress:
            self.write(f"{rank_prefix(event.rank, event.every_rank)}{event.text}")

    def tick(self) -> None:
        pass

    def close(self, ending: Ending) -> None:
        self.write(f"[nbddp] {ending.line()}")
        if ending.metrics_line():
            self.write(f"[nbddp] {ending.metrics_line()}")


class TextMirror:
    """Every rank's lines as text outputs, for front ends that don't render widgets.

    Each flush is a new ``display_data`` (papermill's ``--log-output``, ``jupyter console`` and
    nbclient show or keep those as they come; an updated display they would not) whose ``text/html``
    is empty, so that front ends that render HTML, and the notebook they save, show nothing twice.
    A flush holds at most ``CHUNK_LINES`` lines, as a chunk of the widget view does.
    """

    HTML = '<div class="nbddp-text-copy"></div>'

    def __init__(self, display: Any) -> None:
        self._display = display
        self._pending: list[str] = []
        self.shown = 0

    def add(self, line: str) -> None:
        self._pending.append(line)

    def flush(self) -> None:
        if self._pending:
            self._display({"text/plain": "\n".join(bounded(self._pending)), "text/html": self.HTML}, raw=True)
            self.shown += len(self._pending)
            self._pending = []


def front_end_renders_widgets() -> bool:
    """Whether the cell's request came from a front end known to render widgets.

    JupyterLab and Notebook 7 (both built on JupyterLab's notebook) send ``recordTiming`` with
    every execute request; a front end whose widget manager opened ipywidgets' control channel
    renders them too. Anything else (nbclient, papermill, ``jupyter console``, VS Code) gets the
    text mirror as well, which front ends that render HTML show as nothing.
    """
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
        metadata = kernel.get_parent().get("metadata", {}) if kernel is not None else {}
    except Exception:  # noqa: BLE001 - an odd front end must never break the view
        metadata = {}
    if isinstance(metadata, dict) and "recordTiming" in metadata:
        return True
    try:
        from ipywidgets import Widget

        return getattr(Widget, "_control_comm", None) is not None
    except ImportError:
        return False


class LogPane:
    """One scrolling log pane: lines appended as new chunks, so what is on screen stays put.

    The scroll box is a flex column in reverse: it opens scrolled to the bottom and stays there as
    lines arrive, unless the reader has scrolled up, whose place the browser keeps.
    """

    def __init__(self, w: Any) -> None:
        self._w = w
        self.inner = w.VBox(layout=w.Layout(flex="0 0 auto", width="100%"))
        self.scroller = w.Box([self.inner], layout=w.Layout(
            height=f"{PANE_HEIGHT_PX}px", overflow="auto", display="flex", flex_flow="column-reverse"))
        self.footer: Any = None
        """The current state of a ``\\r`` progress bar, under the lines: made when the first one comes (every widget
        the view makes at its start delays its first line by ~1 ms in a kernel)."""
        self.widget = w.VBox([self.scroller], layout=w.Layout(width="100%"))
        self.widget.add_class("nbddp-pane")
        self.lines: deque[str] = deque(maxlen=KEEP_LINES)
        self.dropped = 0
        self._pending: list[str] = []
        self._progress: str | None = None
        self._progress_dirty = False

    def add(self, text: str) -> None:
        if len(self.lines) == self.lines.maxlen:
            self.dropped += 1
        self.lines.append(text)
        self._pending.append(text)

    def progress(self, text: str) -> None:
        self._progress, self._progress_dirty = text, True

    def pending(self) -> bool:
        """Lines not shown yet."""
        return bool(self._pending)

    def flush(self) -> None:
        if self._pending:
            if len(self.inner.children) >= MAX_CHUNKS:
                self.inner.children = (self._chunk(self.lines),)
            else:
                self.inner.children = (*self.inner.children, self._chunk(self._pending))
            self._pending = []
        if self._progress_dirty:
            self._progress_dirty = False
            if self.footer is None:
                self.footer = self._w.HTML(layout=self._w.Layout(margin="0"))
                self.widget.children = (*self.widget.children, self.footer)
            self.footer.value = f"<pre class='nbddp-lines'>{html.escape(self._progress or '')}</pre>"

    def _chunk(self, lines: Sequence[str]) -> Any:
        return self._w.HTML(f"<pre class='nbddp-lines'>{html.escape(chr(10).join(bounded(lines)))}</pre>",
                            layout=self._w.Layout(margin="0"))


def bounded(lines: Sequence[str]) -> list[str]:
    """At most ``CHUNK_LINES`` lines, the last ones, under a line saying how many were skipped."""
    if len(lines) <= CHUNK_LINES:
        return list(lines)
    skipped = len(lines) - CHUNK_LINES
    return [f"… {skipped:,} lines skipped here (the run dir's logs have every line)", *lines[-CHUNK_LINES:]]


class WidgetView:
    """Progress bar and status; a log pane for all ranks and one per rank; the live metric plot."""

    def __init__(self, ranks: Sequence[int], run_dir: Path | None = None, title: str = "nbddp",
                 mirror: bool | None = None) -> None:
        """``mirror``: send every line as text too (default: unless the front end renders widgets)."""
        import ipywidgets as w
        from IPython.display import display

        self._w = w
        self.started = time.monotonic()
        self.run_dir = run_dir
        self.title = title
        self.metrics: list[dict[str, Any]] = []
        self.memory: dict[int, int] = {}
        self.progress = w.FloatProgress(value=0.0, min=0.0, max=1.0, layout=w.Layout(width="30%"))
        self.status = w.HTML(layout=w.Layout(width="70%"))
        self.everything = LogPane(w)
        self.panes: dict[int | None, LogPane] = {rank: LogPane(w) for rank in ranks}
        self.tabs = w.Tab(children=[self.everything.widget, *(p.widget for p in self.panes.values())],
                          titles=["all ranks", *(f"rank {r}" for r in ranks)],
                          layout=w.Layout(flex="3 1 0%", min_width="0"))
        self.plot: Any = None  # made with the first metrics, as a pane's footer is
        self.lower = w.HBox([self.tabs], layout=w.Layout(align_items="flex-start"))
        self.box = w.VBox([w.HBox([self.progress, self.status]), self.lower])
        self.box.add_class("nbddp-view")
        self._plotted = self._shown_seconds = -1
        self._last_refresh = 0.0
        self._allowance, self._allowance_at = float(BURST_REFRESHES), time.monotonic()
        self._update_status()
        self.nproc = len(ranks)
        self.mirror = TextMirror(display) if (not front_end_renders_widgets() if mirror is None else mirror) else None
        self.handle = display(self._live_bundle(), raw=True, display_id=True)

    def __call__(self, event: Event) -> None:
        if isinstance(event, LogLine):
            prefixed = f"{rank_prefix(event.rank, event.every_rank)}{event.text}"
            pane = self._pane(event.rank) if not event.every_rank else None
            if event.progress:
                (pane or self.everything).progress(event.text if pane else prefixed)
                return
            self.everything.add(prefixed)
            if self.mirror is not None:
                self.mirror.add(prefixed)
            if event.every_rank:
                for pane in self.panes.values():
                    pane.add(event.text)
            elif pane is not None:
                pane.add(event.text)
        elif isinstance(event, MetricsEvent):
            self.metrics.append(event.values)
        elif isinstance(event, MemoryEvent):
            self.memory = event.peaks

    def tick(self) -> None:
        """Refresh what changed; the run's loop calls it after each poll's events (so a poll's lines are one
        update, not one each): new lines at once while the allowance lasts (``BURST_REFRESHES``, refilled by
        one every ``REFRESH_SECONDS``), else at the next refresh; the clock at most every ``REFRESH_SECONDS``."""
        now = time.monotonic()
        self._allowance = min(BURST_REFRESHES, self._allowance + (now - self._allowance_at) / REFRESH_SECONDS)
        self._allowance_at = now
        pending = self.everything.pending()
        if pending and self._allowance >= 1:
            self._allowance -= 1
            self.refresh()
        elif now - self._last_refresh >= REFRESH_SECONDS:
            if pending:
                self._allowance = 0.0
            self.refresh()

    def refresh(self) -> None:
        self._last_refresh = time.monotonic()
        self.everything.flush()
        for pane in self.panes.values():
            pane.flush()
        if self.mirror is not None:
            self.mirror.flush()
        if len(self.metrics) != self._plotted or int(time.monotonic() - self.started) != self._shown_seconds:
            self._update_status()
        if len(self.metrics) != self._plotted:
            self._plotted = len(self.metrics)
            plot = svg_plot(self.metrics)
            if plot:
                if self.plot is None:
                    self.plot = self._w.HTML(layout=self._w.Layout(flex="2 1 0%", min_width="0"))
                    self.lower.children = (*self.lower.children, self.plot)
                self.plot.value = plot

    def close(self, ending: Ending) -> None:
        """Replace the live view by its static copy, and free the widgets.

        Where the lines went out as text (the mirror), the ending is one more text output after them,
        so that it is the cell's last in the notebook and in papermill's ``--log-output`` (which logs
        new outputs only, never an updated one); the view's own output keeps its first line as text.
        """
        self.refresh()
        panes = [("all ranks", list(self.everything.lines))]
        panes += [(f"rank {rank}" if rank is not None else "launcher", list(p.lines)) for rank, p in self.panes.items()]
        html_copy = snapshot_html(ending, panes, self.metrics)
        if self.mirror is None:
            self.handle.update({"text/html": html_copy, "text/plain": snapshot_text(
                ending, self.everything.lines, self.everything.dropped)}, raw=True)
        else:
            self.handle.update({"text/html": html_copy, "text/plain": self._live_text()}, raw=True)
            for line in snapshot_text(ending, ()).split("\n"):
                self.mirror.add(line)
            self.mirror.flush()
        _close_tree(self.box)

    def _pane(self, rank: int | None) -> LogPane:
        if rank not in self.panes:  # a rank (or the launcher) not foreseen: a new tab at the end
            self.panes[rank] = LogPane(self._w)
            self.tabs.children = (*self.tabs.children, self.panes[rank].widget)
            self.tabs.titles = (*self.tabs.titles, rank_prefix(rank).strip(" []"))
        return self.panes[rank]

    def _update_status(self) -> None:
        seconds = int(time.monotonic() - self.started)
        self._shown_seconds = seconds
        last = self.metrics[-1] if self.metrics else {}
        epoch, epochs = last.get("epoch"), last.get("epochs")
        if isinstance(epoch, (int, float)) and isinstance(epochs, (int, float)) and epochs > 0:
            self.progress.max, self.progress.value = float(epochs), float(min(epoch, epochs))
            text = f"epoch {epoch:g}/{epochs:g}"
            values = curves(last)
            text += f" · {format_metrics(values)}" if values else ""
        elif last:
            text = format_metrics(curves(last)) or "running"
        else:
            text = "starting…" if not any(p.lines for p in self.panes.values()) else "running"
        if self.memory:
            text += f" · {describe_memory(self.memory)}"
        where = f" · {html.escape(shown_path(self.run_dir))}" if self.run_dir else ""
        self.status.value = (
            f"{_STYLE}<span class='nbddp-live'><b>{html.escape(self.title)}</b> {html.escape(text)} · "
            f"{seconds}s{where}</span>"
            f"<span class='nbddp-gone'><b>the kernel restarted: this run was stopped</b> after {seconds}s"
            f"{' · its logs are in ' + html.escape(shown_path(self.run_dir)) if self.run_dir else ''}</span>")

    def _live_text(self) -> str:
        """The view's text, for what doesn't render its widgets: why there is no live view here (ipywidgets
        is installed in this kernel, or there would be no widget view at all)."""
        why = ("this front end does not render widgets: every rank's lines follow as text" if self.mirror is not None
               else "the live view is a widget, which this front end did not render: it needs ipywidgets where "
                    "Jupyter runs too")
        where = f"; its logs are in {shown_path(self.run_dir)}" if self.run_dir else ""
        return f"[nbddp] training on {self.nproc} processes ({why}){where}"

    def _live_bundle(self) -> dict[str, Any]:
        return {"text/plain": self._live_text(),
                WIDGET_MIME: {"model_id": self.box.model_id, "version_major": 2, "version_minor": 0}}


def _close_tree(widget: Any) -> None:
    """Close a widget, its children and their layouts and styles: the kernel forgets them all."""
    for child in getattr(widget, "children", ()):
        _close_tree(child)
    for part in (getattr(widget, "layout", None), getattr(widget, "style", None)):
        if part is not None:
            part.close()
    widget.close()


def make_view(ranks: Sequence[int], run_dir: Path | None = None, mode: str | None = None) -> TextView | WidgetView:
    """``WidgetView`` inside a kernel with ipywidgets, else ``TextView``. ``NBDDP_VIEW`` overrides."""
    import os

    mode = mode or os.environ.get("NBDDP_VIEW", "auto")
    if mode != "text":
        try:
            from IPython import get_ipython

            shell = get_ipython()
            in_kernel = shell is not None and getattr(shell, "kernel", None) is not None
            if in_kernel or mode == "widgets":
                return WidgetView(ranks, run_dir)
        except ImportError:
            pass
    return TextView()
