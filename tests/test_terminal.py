"""What `nbddp run` prints: rank lines, and on a terminal tqdm's epoch bar; metrics are never echoed as lines."""

from nbddp.job.follow import LogLine, MetricsEvent
from nbddp.display.terminal import NotebookOutputSink, TerminalSink


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
