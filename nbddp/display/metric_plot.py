"""The live metric plot as SVG: crisp at any size, and needing nothing beyond the standard library.

The live view and its static copy embed it in HTML. Being vector, it is drawn at whatever size
the page gives it (no blurry stretched PNG), and drawing it takes about a millisecond, so the
plot can be redrawn with every status update (the two never disagree). A plain ``pip install
nbddp`` has it: no matplotlib.

Epochs (or record numbers) run along x with whole-number ticks; the y-axis is logarithmic when a
metric spans more than 10× (a loss going 3.3 → 0.02 stays readable after epoch 2).
"""

from __future__ import annotations

import html
import math
from typing import Any, Sequence

from nbddp.contracts.metrics import curves

#: Matplotlib's default colour cycle: familiar to readers of training plots.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
LOG_SPAN = 10.0


def series(metrics: Sequence[dict[str, Any]]) -> tuple[str, dict[str, list[tuple[float, float]]]]:
    """``(x label, {metric: [(x, y), …]})``: x is the record's epoch where it has one, else its number."""
    by_epoch = any(isinstance(r.get("epoch"), (int, float)) for r in metrics)
    lines: dict[str, list[tuple[float, float]]] = {}
    for i, record in enumerate(metrics):
        x = record.get("epoch", i + 1) if by_epoch else i + 1
        if not isinstance(x, (int, float)):
            continue
        for name, y in curves(record).items():
            lines.setdefault(name, []).append((float(x), y))
    return ("epoch" if by_epoch else "record"), lines


def use_log_scale(values: Sequence[float]) -> bool:
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and bool(values) and max(values) / min(values) > LOG_SPAN


def nice_ticks(low: float, high: float, count: int = 5, integer: bool = False) -> list[float]:
    """About ``count`` round tick values covering ``[low, high]`` (1, 2 or 5 × a power of ten)."""
    if high <= low:
        high = low + (1 if integer else abs(low) * 0.1 or 1.0)
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    if integer:
        step = max(1.0, round(step))
    start = math.floor(low / step) * step
    ticks, value = [], start
    while value <= high + step * 1e-9:
        if value >= low - step * 1e-9:
            ticks.append(round(value, 12))
        value += step
    return ticks


def log_ticks(low: float, high: float) -> list[float]:
    """Powers of ten within ``[low, high]``, with 2× and 5× steps when the span is under three decades."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    multiples = (1, 2, 5) if last - first <= 3 else (1,)
    ticks = [m * 10.0 ** e for e in range(first, last + 1) for m in multiples]
    inside = [t for t in ticks if low <= t <= high]
    return inside or [low, high]


def label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.0e}".replace("e-0", "e-").replace("e+0", "e")
    return f"{value:.4g}"


def svg_plot(metrics: Sequence[dict[str, Any]], width: int = 420, height: int = 220, x_name: str | None = None) -> str:
    """An SVG line chart of every metric against epoch; ``""`` when nothing is plottable.

    ``width``/``height`` set the drawing's proportions; it scales to its container (``viewBox``). ``x_name``: what
    the records' ``epoch`` counts, where it is not epochs (a study's trials, a trial's steps).
    """
    xlabel, lines = series(metrics)
    xlabel = x_name or xlabel
    if not lines:
        return ""
    xs = [x for points in lines.values() for x, _ in points]
    ys = [y for points in lines.values() for _, y in points]
    log = use_log_scale(ys)
    left, right, top, bottom = 52, 12, 12 + 14 * ((len(lines) + 2) // 3), 34
    plot_w, plot_h = width - left - right, height - top - bottom
    integer_x = all(float(x).is_integer() for x in xs)
    x_ticks = nice_ticks(min(xs), max(xs), 6, integer=integer_x)
    x_low, x_high = min(x_ticks[0], min(xs)), max(x_ticks[-1], max(xs))
    if log:
        y_low, y_high = min(ys), max(ys)
        y_ticks = log_ticks(y_low, y_high)
        t_low, t_high = math.log10(y_low), math.log10(y_high)
        pad = (t_high - t_low) * 0.05
        t_low, t_high = t_low - pad, t_high + pad

        def ty(y: float) -> float:
            return top + plot_h * (1 - (math.log10(y) - t_low) / (t_high - t_low))
    else:
        y_ticks = nice_ticks(min(ys), max(ys), 5)
        y_low, y_high = min(y_ticks[0], min(ys)), max(y_ticks[-1], max(ys))

        def ty(y: float) -> float:
            return top + plot_h * (1 - (y - y_low) / ((y_high - y_low) or 1.0))

    def tx(x: float) -> float:
        return left + plot_w * ((x - x_low) / ((x_high - x_low) or 1.0))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" '
             f'preserveAspectRatio="xMidYMid meet" font-family="sans-serif" font-size="11" '
             f'role="img" aria-label="metrics by {xlabel}" class="nbddp-plot">',
             f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>']
    for t in x_ticks:
        x = tx(t)
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}" stroke="#ddd"/>'
                     f'<text x="{x:.1f}" y="{top + plot_h + 13}" text-anchor="middle" fill="#444">'
                     f'{int(t) if integer_x else label(t)}</text>')
    for t in y_ticks:
        y = ty(t)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" fill="#444">{label(t)}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 4}" text-anchor="middle" fill="#444">'
                 f'{xlabel}{" (y: log scale)" if log else ""}</text>')
    for i, (name, points) in enumerate(sorted(lines.items())):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{tx(x):.1f},{ty(y):.1f}" for x, y in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.6"/>')
        if len(points) <= 60:
            parts.extend(f'<circle cx="{tx(x):.1f}" cy="{ty(y):.1f}" r="2" fill="{colour}"/>' for x, y in points)
        lx, ly = left + (i % 3) * (plot_w / 3), 18 + 14 * (i // 3)
        parts.append(f'<rect x="{lx:.1f}" y="{ly - 8}" width="10" height="3" fill="{colour}"/>'
                     f'<text x="{lx + 14:.1f}" y="{ly - 4}" fill="#222">{html.escape(name)} '
                     f'{points[-1][1]:.4g}</text>')
    parts.append("</svg>")
    return "".join(parts)
