"""A batch at a glance: ``summary.csv``, ``summary.md`` and ``summary.png`` in its folder.

One row per run: its parameters, status, wall time, final metrics (the last
``nbddp.log`` record, which for Catalyst holds its train/valid metrics) and,
for a run that didn't succeed, its error in one line (for an exception: rank, cell, line, type and message).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

from nbddp.contracts.atomic import read_json
from nbddp.contracts.metrics import COUNTERS, read_metrics
from nbddp.job.record import error_line
from nbddp.contracts.status import BatchState
from nbddp.contracts.rundir import RunDir


def summarize(out: Path, runs: Sequence[tuple[Any, RunDir, str]]) -> list[dict[str, Any]]:
    """Write the summary files for ``runs`` (``(planned run, run dir, status)``) and return the rows."""
    rows, curves, metric_names = [], {}, []
    for run, paths, status in runs:
        result = read_json(paths.result) or {}
        state = BatchState(status)
        row: dict[str, Any] = {"run": run.name, **run.parameters,
                               "status": str(BatchState.SUCCEEDED if state.ok else state)}
        row["wall_time_s"] = result.get("wall_time_s")
        for key, value in (result.get("final_metrics") or {}).items():
            if key not in COUNTERS:
                row[key] = value
                if key not in metric_names:
                    metric_names.append(key)
        row["error"] = error_line(result.get("status", ""), result.get("error"), result.get("failure")) or (
            "" if state.ok else _last_line(paths.batch_log, state))
        row["run_dir"] = str(paths)
        rows.append(row)
        curves[run.name] = read_metrics(paths)
    columns = _columns(rows)
    _write_csv(out / "summary.csv", rows, columns)
    metric = main_metric(metric_names)
    _write_markdown(out / "summary.md", rows, columns, metric)
    _write_plot(out / "summary.png", rows, curves, metric)
    return rows


def main_metric(metric_names: Sequence[str]) -> str | None:
    """The metric to compare runs by: a validation loss if there is one, else a loss, else the first."""
    for preference in (lambda n: "valid" in n and "loss" in n, lambda n: "loss" in n, lambda n: True):
        for name in metric_names:
            if preference(name):
                return name
    return None


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    tail = [c for c in ("error", "run_dir") if c in columns]
    return [c for c in columns if c not in tail] + tail


def _write_csv(path: Path, rows: Sequence[dict[str, Any]], columns: list[str]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _write_markdown(path: Path, rows: Sequence[dict[str, Any]], columns: list[str], metric: str | None) -> None:
    shown = [c for c in columns if c != "run_dir"]
    lines = [f"# Batch summary: {len(rows)} runs, "
             f"{sum(r['status'] == BatchState.SUCCEEDED for r in rows)} succeeded, "
             f"{sum(r['status'] != BatchState.SUCCEEDED for r in rows)} failed or stopped", ""]
    if metric:
        ok = [r for r in rows if isinstance(r.get(metric), (int, float))]
        if ok:
            best = min(ok, key=lambda r: r[metric]) if "loss" in metric else max(ok, key=lambda r: r[metric])
            lines += [f"Main metric: `{metric}`; best run: `{best['run']}` ({_cell(best[metric])}).", ""]
    lines.append("| " + " | ".join(shown) + " |")
    lines.append("|" + "---|" * len(shown))
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in shown) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_plot(path: Path, rows: Sequence[dict[str, Any]], curves: dict[str, list[dict]], metric: str | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return
    figure = Figure(figsize=(11, 4), dpi=90)
    left, right = figure.subplots(1, 2)
    names = [r["run"] for r in rows]
    values = [r.get(metric) if isinstance(r.get(metric), (int, float)) else 0.0 for r in rows]
    colors = ["tab:blue" if r["status"] == BatchState.SUCCEEDED else "tab:red" for r in rows]
    left.barh(range(len(rows)), values, color=colors)
    left.set_yticks(range(len(rows)), names, fontsize=7)
    left.invert_yaxis()
    left.set_title(f"final {metric or 'metric'} per run (red: failed)", fontsize=9)
    for name, records in curves.items():
        points = [(r.get("epoch", i + 1), r[metric]) for i, r in enumerate(records)
                  if metric and isinstance(r.get(metric), (int, float))]
        if points:
            right.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=name)
    right.set_title(f"{metric or 'metric'} during training", fontsize=9)
    right.set_xlabel("epoch")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers: no tick at 1.2
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=6)
    right.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)


def _last_line(path: Path, status: str) -> str:
    """Why a run that wrote no result.json ended: the last line it printed."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return lines[-1] if lines else f"no result ({status})"

