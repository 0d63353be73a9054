"""The widget view's log pane without a kernel: ipywidgets 8 builds widgets on a dummy comm."""

import html
import re

from tests.extras import need

need("ipywidgets")

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


class _Display:
    """IPython's ``display`` outside a kernel: records what would be shown (``display_id`` gives a handle)."""

    def __init__(self):
        self.shown = []

    def __call__(self, bundle, raw=False, display_id=None):
        self.shown.append(bundle)
        return self if display_id else None

    def update(self, bundle, raw=False):
        self.shown.append(bundle)


def test_front_ends_without_widgets_get_lines_as_text_at_once_until_they_keep_coming(monkeypatch):
    import IPython.display

    from nbddp.doors.jupyter import view as view_module
    from nbddp.display.ending import Ending
    from nbddp.job.follow import LogLine

    shown = _Display()
    monkeypatch.setattr(IPython.display, "display", shown)
    view = view_module.WidgetView([0, 1], mirror=True)
    copies = lambda: [b["text/plain"] for b in shown.shown if b.get("text/html") == view_module.TextMirror.HTML]  # noqa: E731
    now = view._allowance_at
    monkeypatch.setattr(view_module.time, "monotonic", lambda: now)
    at_once = [f"[rank 0] line {i}" for i in range(view_module.BURST_REFRESHES)]
    for line in at_once:  # polls that each brought a line (nbddp's "rank 0/2 started", the user's first): at once
        view(LogLine(0, line.removeprefix("[rank 0] ")))
        view.tick()  # (the run's loop ticks after each poll's events)
    assert copies() == at_once
    view(LogLine(1, "second"))
    view(LogLine(0, "a bar", progress=True))  # progress bars stay in the view
    view.tick()
    assert copies() == at_once  # while lines keep coming: gathered...
    now += view_module.REFRESH_SECONDS
    view.tick()
    assert copies() == [*at_once, "[rank 1] second"]  # ...into one update per refresh
    view(LogLine(1, "third"))
    view.tick()
    assert copies() == [*at_once, "[rank 1] second"]  # (the allowance is spent)
    view.close(Ending("succeeded", 1.0, None, "model loaded on the CPU"))
    *_, copy, last = shown.shown
    assert shown.shown[0]["text/plain"] == copy["text/plain"] == \
        "[nbddp] training on 2 processes (this front end does not render widgets: every rank's lines follow as text)"
    assert "nbddp-snapshot" in copy["text/html"] and "succeeded" not in copy["text/plain"]  # the view's own output
    assert last == {"text/plain": "[nbddp] succeeded in 1.0s · model loaded on the CPU",  # the ending: the last output,
                    "text/html": view_module.TextMirror.HTML}  # after the lines, its HTML in the copy only


def test_a_polls_lines_are_one_update(monkeypatch):
    """The allowance counts updates, not lines: a poll that brought many lines (every rank's start
    line, say) spends one, and the next poll's line still shows at once."""
    import IPython.display

    from nbddp.doors.jupyter import view as view_module
    from nbddp.job.follow import LogLine

    shown = _Display()
    monkeypatch.setattr(IPython.display, "display", shown)
    view = view_module.WidgetView(list(range(8)), mirror=True)
    copies = lambda: [b["text/plain"] for b in shown.shown if b.get("text/html") == view_module.TextMirror.HTML]  # noqa: E731
    for rank in range(8):
        view(LogLine(rank, f"rank {rank}/8 started"))
    view.tick()
    view(LogLine(0, "the first line"))
    view.tick()
    assert len(copies()) == 2 and copies()[1] == "[rank 0] the first line"


def test_a_burst_reaches_text_front_ends_bounded_as_the_view_bounds_it():
    from nbddp.doors.jupyter.view import TextMirror

    shown = _Display()
    mirror = TextMirror(shown)
    for i in range(CHUNK_LINES + 10):
        mirror.add(f"line {i}")
    mirror.flush()
    mirror.flush()  # nothing new: nothing shown
    [bundle] = shown.shown
    lines = bundle["text/plain"].splitlines()
    assert lines[0].startswith("… 10 lines skipped here") and len(lines) == CHUNK_LINES + 1
    assert mirror.shown == CHUNK_LINES + 10


def test_outside_a_kernel_no_front_end_is_known_to_render_widgets():
    from nbddp.doors.jupyter.view import front_end_renders_widgets

    assert not front_end_renders_widgets()


def test_a_panes_progress_line_is_made_when_the_first_one_comes():
    """Every widget made when the view starts delays its first line (~1 ms each in a kernel): a pane's
    progress footer, like the plot, is made when it is first needed."""
    import ipywidgets as w

    pane = LogPane(w)
    assert pane.widget.children == (pane.scroller,)
    pane.progress("42%|████")
    pane.flush()
    assert len(pane.widget.children) == 2 and "42%" in pane.footer.value
    pane.progress("43%|████")
    pane.flush()
    assert len(pane.widget.children) == 2 and "43%" in pane.footer.value


def test_a_front_end_expected_to_render_widgets_is_told_what_its_view_needs_if_it_does_not(monkeypatch):
    import IPython.display

    from nbddp.doors.jupyter import view as view_module

    shown = _Display()
    monkeypatch.setattr(IPython.display, "display", shown)
    view_module.WidgetView([0, 1], mirror=False)
    assert shown.shown[0]["text/plain"] == ("[nbddp] training on 2 processes (the live view is a widget, which this "
                                            "front end did not render: it needs ipywidgets where Jupyter runs too)")


def test_a_ranks_markup_and_control_characters_are_text_in_the_pane():
    """The notebook's view shows a rank's line as text: its markup is escaped (no script, no tag), and no control
    character can reach a terminal from a browser's page (the terminal door escapes them: tests/test_terminal.py)."""
    import ipywidgets as w

    pane = LogPane(w)
    line = "<script>alert(1)</script><img src=x onerror=alert(2)> \x1b]52;c;eA==\x07 & done"
    pane.add(line)
    pane.flush()
    [chunk] = pane.inner.children
    assert "<script>" not in chunk.value and "<img" not in chunk.value
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&lt;img src=x onerror=alert(2)&gt;" in chunk.value
    assert _text(chunk) == line
