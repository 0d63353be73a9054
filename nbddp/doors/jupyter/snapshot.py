"""The static copy a ``%%ddp_train`` cell keeps once its run has ended, however it ended.

Widgets live only as long as their kernel: a reopened notebook, nbviewer, GitHub or a restarted
kernel would show "model not found" where the live view was. So the view's output is replaced,
at the end, by plain HTML (and a text copy for what can't render HTML): the ending line, the
final metrics, the plot as an image, each rank's last lines, the run dir. No script, no widget.
"""

from __future__ import annotations

import base64
import html
from typing import Sequence

from nbddp.display.ending import Ending, shown_path
from nbddp.display.metric_plot import svg_plot
from nbddp.contracts.status import Status

SNAPSHOT_LINES = 20
_COLOURS = {Status.SUCCEEDED: "#2e7d32", Status.FAILED: "#c62828", Status.TIMEOUT: "#ef6c00",
            Status.INTERRUPTED: "#616161"}
_MARKS = {Status.SUCCEEDED: "✔", Status.FAILED: "✘", Status.TIMEOUT: "⏱", Status.INTERRUPTED: "■"}


def snapshot_html(ending: Ending, panes: Sequence[tuple[str, Sequence[str]]], metrics: Sequence[dict]) -> str:
    """The HTML of the static copy. ``panes``: ``(title, lines)``, the all-ranks pane first."""
    colour = _COLOURS.get(ending.status, "#616161")
    parts = ['<div class="nbddp-snapshot" style="font-size:13px;line-height:1.4">',
             f'<div style="border-left:4px solid {colour};padding:2px 8px;margin-bottom:4px">'
             f'<b style="color:{colour}">{_MARKS.get(ending.status, "")} nbddp</b> {html.escape(ending.line())}</div>']
    if ending.metrics_line():
        parts.append(f'<div style="padding:0 12px 4px">{html.escape(ending.metrics_line())}</div>')
    plot = svg_plot(metrics)
    parts.append('<div style="display:flex;flex-wrap:wrap;gap:8px;align-items:flex-start">')
    parts.append('<div style="flex:3 1 420px;min-width:0">')
    for i, (title, lines) in enumerate(panes):
        shown = list(lines)[-SNAPSHOT_LINES:]
        if not shown:
            continue
        more = f" (last {len(shown)} lines)" if len(lines) > len(shown) else ""
        parts.append(f'<details{" open" if i == 0 else ""}><summary>{html.escape(title)}{more}</summary>'
                     f'<pre style="margin:2px 0;overflow-x:auto;font-size:12px">'
                     f'{html.escape(chr(10).join(shown))}</pre></details>')
    parts.append("</div>")
    if plot:
        data = base64.b64encode(plot.encode()).decode()
        parts.append(f'<div style="flex:2 1 320px;max-width:560px"><img alt="metrics" style="width:100%" '
                     f'src="data:image/svg+xml;base64,{data}"/></div>')
    parts.append("</div></div>")
    return "".join(parts)


def snapshot_text(ending: Ending, lines: Sequence[str], dropped: int = 0) -> str:
    """The text copy: every kept line of all ranks, then the ending (papermill and nbclient store this)."""
    text = list(lines)
    if dropped and ending.run_dir is not None:
        text.insert(0, f"[nbddp] {dropped} earlier lines: see {shown_path(ending.run_dir / 'logs')}")
    text.append(f"[nbddp] {ending.line()}")
    if ending.metrics_line():
        text.append(f"[nbddp] {ending.metrics_line()}")
    return "\n".join(text)
