"""What a running ``%%ddp_train`` cell shows: ipywidgets where they render, text elsewhere.

The widget view is displayed as one output whose bundle carries both the
widget and a ``text/plain`` copy of the logs, kept current with
``update_display``: JupyterLab, Notebook and VS Code draw the widget, while
nbclient/papermill store the text as it arrives, so an executed notebook
holds the ranks' logs. A terminal IPython, which can't update a display,
gets the lines printed as they come. Updates happen in the thread running the
cell (ipykernel's output from background threads changed across versions).
"""

from __future__ import annotations

import html
import io
import time
from collections import deque
from typing import Any

from nbddp.stream import Event, LogLine, MetricsEvent, format_metrics, rank_prefix

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
REFRESH_SECONDS = 0.3
PLOT_SECONDS = 2.0
KEEP_LINES = 400
PANE_LINES = 20
#: Metric keys that are counters, not curves.
_AXES = {"epoch", "epochs", "step", "time"}


class TextView:
    """Plain text: each line printed as it arrives (terminal IPython, plain Python)."""

    def __init__(self, write=print) -> None:
        self.write = write

    def __call__(self, event: Event) -> None:
        if isinstance(event, LogLine) and not event.progress:
            self.write(f"{rank_prefix(event.rank)}{event.text}")
        elif isinstance(event, MetricsEvent):
            self.write(f"[metrics] {format_metrics(event.values)}")

    def close(self, status: str) -> None:
        pass


class WidgetView:
    """Progress bar, one log pane per rank plus all ranks together, and a live metric plot."""

    def __init__(self, nproc: int, title: str = "nbddp") -> None:
        import ipywidgets as w
        from IPython.display import display

        self.started = time.monotonic()
        self.lines: deque[str] = deque(maxlen=KEEP_LINES)
        self.rank_lines: dict[int | None, deque[str]] = {}
        self.metrics: list[dict[str, Any]] = []
        self.progress = w.FloatProgress(value=0.0, min=0.0, max=1.0, description="training",
                                        layout=w.Layout(width="60%"))
        self.status = w.HTML(f"<b>{html.escape(title)}</b>: starting {nproc} processes…")
        self.panes = w.Tab()
        self.plot = w.Image(format="png", layout=w.Layout(display="none"))
        self.box = w.VBox([w.HBox([self.progress, self.status]), self.panes, self.plot])
        self._last_refresh = self._last_plot = 0.0
        self._dirty_plot = False
        self.handle = display(self._bundle(), raw=True, display_id=True)

    def __call__(self, event: Event) -> None:
        if isinstance(event, LogLine):
            text = f"{rank_prefix(event.rank)}{event.text}"
            if not event.progress:
                self.lines.append(text)
            self.rank_lines.setdefault(event.rank, deque(maxlen=KEEP_LINES)).append(event.text)
        elif isinstance(event, MetricsEvent):
            self.metrics.append(event.values)
            self.lines.append(f"[metrics] {format_metrics(event.values)}")
            self._dirty_plot = True
        if time.monotonic() - self._last_refresh > REFRESH_SECONDS:
            self.refresh()

    def refresh(self, final: bool = False) -> None:
        if not self.metrics and not final:
            plot_png([])  # import matplotlib now, while the ranks start, not at the first metric
        self._last_refresh = time.monotonic()
        self._update_progress()
        self._update_panes()
        if self._dirty_plot and (final or time.monotonic() - self._last_plot > PLOT_SECONDS):
            self._update_plot()
        self.handle.update(self._bundle(), raw=True)

    def close(self, status: str) -> None:
        self.refresh(final=True)
        elapsed = time.monotonic() - self.started
        self.status.value = f"<b>{html.escape(status)}</b> after {elapsed:.1f}s"
        if status == "succeeded":
            self.progress.value, self.progress.bar_style = self.progress.max, "success"
        else:
            self.progress.bar_style = "danger"
        self.handle.update(self._bundle(), raw=True)

    def _bundle(self) -> dict[str, Any]:
        return {
            "text/plain": "\n".join(self.lines) or "[nbddp] starting…",
            WIDGET_MIME: {"model_id": self.box.model_id, "version_major": 2, "version_minor": 0},
        }

    def _update_progress(self) -> None:
        last = self.metrics[-1] if self.metrics else {}
        elapsed = time.monotonic() - self.started
        if "epoch" in last and last.get("epochs"):
            self.progress.max = float(last["epochs"])
            self.progress.value = float(last["epoch"])
            self.status.value = f"epoch {last['epoch']}/{last['epochs']} · {format_metrics(_curves(last))} · {elapsed:.0f}s"
        elif last:
            self.status.value = f"{format_metrics(last)} · {elapsed:.0f}s"
        else:
            self.status.value = f"running · {elapsed:.0f}s"

    def _update_panes(self) -> None:
        import ipywidgets as w

        ranks = sorted(self.rank_lines, key=lambda r: (r is not None, r or 0))
        if len(self.panes.children) != len(ranks) + 1:
            self.panes.children = [w.HTML() for _ in range(len(ranks) + 1)]
            for i, rank in enumerate(["all ranks", *ranks]):
                self.panes.set_title(i, rank if isinstance(rank, str) else rank_prefix(rank).strip(" []"))
        # The newest lines, always in view (a scrolled pane would sit at the top); every line is in
        # logs/rank-N.log and in the text copy of this output.
        texts = [list(self.lines)] + [list(self.rank_lines[r]) for r in ranks]
        for pane, lines in zip(self.panes.children, texts):
            shown = "\n".join(lines[-PANE_LINES:])
            pane.value = f"<pre style='margin:0;font-size:85%'>{html.escape(shown)}</pre>"

    def _update_plot(self) -> None:
        self._last_plot, self._dirty_plot = time.monotonic(), False
        png = plot_png(self.metrics)
        if png:
            self.plot.value = png
            self.plot.layout.display = None


def _curves(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in _AXES and isinstance(v, (int, float))}


def plot_png(metrics: list[dict[str, Any]]) -> bytes:
    """A PNG of every numeric metric against epoch (or record number); empty without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:
        return b""
    names = sorted({k for record in metrics for k in _curves(record)})
    if not names:
        return b""
    figure = Figure(figsize=(7, 2.6), dpi=90)
    axes = figure.subplots()
    for name in names:
        points = [(r.get("epoch", i + 1), r[name]) for i, r in enumerate(metrics) if name in r]
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=name)
    axes.set_xlabel("epoch" if any("epoch" in r for r in metrics) else "record")
    axes.legend(fontsize=7, loc="best")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def make_view(nproc: int, mode: str | None = None):
    """``WidgetView`` inside a kernel with ipywidgets, else ``TextView``. ``NBDDP_VIEW`` overrides."""
    import os

    mode = mode or os.environ.get("NBDDP_VIEW", "auto")
    if mode != "text":
        try:
            from IPython import get_ipython

            shell = get_ipython()
            in_kernel = shell is not None and getattr(shell, "kernel", None) is not None
            if in_kernel or mode == "widgets":
                return WidgetView(nproc)
        except ImportError:
            pass
    return TextView()
