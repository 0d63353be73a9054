"""The live view's SVG plot: whole-number epochs, a log axis for a metric spanning more than 10×, no counters."""

import re
import xml.etree.ElementTree as ET

from nbddp.display.metric_plot import nice_ticks, svg_plot, use_log_scale

SVG = "{http://www.w3.org/2000/svg}"


def texts(svg: str) -> list[str]:
    return [t.text for t in ET.fromstring(svg).iter(f"{SVG}text")]


def test_loss_falling_by_orders_of_magnitude_gets_a_log_axis_and_whole_epochs():
    records = [{"epoch": e, "epochs": 8, "loss": 3.3 * 0.5 ** (e * 1.2), "time": 1.0 + e} for e in range(1, 9)]
    svg = svg_plot(records)
    labels = texts(svg)
    assert "epoch (y: log scale)" in labels
    assert {"0.1", "0.01"} <= set(labels) or {"1", "0.1"} <= set(labels)
    x_labels = [t for t in labels if re.fullmatch(r"\d+", t or "")]
    assert x_labels and all(1 <= int(t) <= 8 for t in x_labels)  # whole epochs, within the run
    assert not any(t and ("epochs" in t or "time" in t) for t in labels)  # counters are not curves
    assert len(ET.fromstring(svg).findall(f"{SVG}polyline")) == 1


def test_a_metric_within_10x_stays_linear_and_fractional_x_is_allowed():
    assert not use_log_scale([1.0, 0.5, 0.2]) and use_log_scale([1.0, 0.05])
    assert not use_log_scale([1.0, 0.0])  # zero or negative: never a log axis
    svg = svg_plot([{"accuracy": 0.5}, {"accuracy": 0.7}, {"accuracy": 0.9}])
    assert "record" in texts(svg) and "(y: log scale)" not in svg


def test_nothing_plottable_draws_nothing():
    assert svg_plot([]) == "" and svg_plot([{"epoch": 1, "epochs": 3}, {"note": "text"}]) == ""


def test_ticks_are_round_numbers():
    assert nice_ticks(0, 10, 6) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(1, 3, 6, integer=True) == [1, 2, 3]
