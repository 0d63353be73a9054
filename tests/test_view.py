"""The widget view's log pane without a kernel: ipywidgets 8 builds widgets on a dummy comm."""

import html
import re

import pytest

pytest.importorskip("ipywidgets")

from nbddp.doors.jupyter.view import CHUNK_LINES, KEEP_LINES, MAX_CHUNKS, LogPane  # noqa: E402


def _text(chunk) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", chunk.value))


def test_lines_arrive_as_appended_chunks_and_earlier_chunks_stay():
    import ipywidgets as w

    pane = LogPane(w)
    pane.add("first")
    pane.flush()
    first = pane.inner.children[0]
    pane.add("second")
    pane.add("third")
    pane.flush()
    assert pane.inner.children[0] is first
    assert [_text(c) for c in pane.inner.children] == ["first", "second\nthird"]


def test_a_burst_shows_its_last_lines_under_a_count_of_those_skipped():
    import ipywidgets as w

    pane = LogPane(w)
    for i in range(CHUNK_LINES + 600):
        pane.add(f"line {i} <b>")
    pane.flush()
    [chunk] = pane.inner.children
    lines = _text(chunk).splitlines()
    assert lines[0] == "… 600 lines skipped here (the run dir's logs have every line)"
    assert len(lines) == CHUNK_LINES + 1 and lines[-1] == f"line {CHUNK_LINES + 599} <b>"
    assert len(pane.lines) == KEEP_LINES and pane.dropped == 600


def test_past_max_chunks_the_pane_is_rebuilt_from_its_last_lines():
    import ipywidgets as w

    pane = LogPane(w)
    for i in range(MAX_CHUNKS + 1):
        pane.add(f"line {i}")
        pane.flush()
    [chunk] = pane.inner.children
    assert _text(chunk).splitlines()[-1] == f"line {MAX_CHUNKS}"
    assert len(_text(chunk).splitlines()) == KEEP_LINES
