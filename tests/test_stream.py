"""Following rank logs: partial lines, \\r progress bars, bad bytes, metrics."""

import json

from nbddp.job.follow import LogLine, MetricsEvent, RunFollower


def append(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(data)


def test_lines_arrive_as_written_and_partial_lines_wait(tmp_path):
    follower = RunFollower(tmp_path)
    log = tmp_path / "logs" / "rank-1.log"
    append(log, b"first\nsec")
    assert list(follower.poll()) == [LogLine(1, "first")]
    append(log, b"ond\n")
    assert list(follower.poll()) == [LogLine(1, "second")]
    append(log, b"no newline at the end")
    assert list(follower.poll()) == []
    assert list(follower.poll(final=True)) == [LogLine(1, "no newline at the end")]


def test_utf8_split_across_writes_and_invalid_bytes(tmp_path):
    follower = RunFollower(tmp_path)
    log = tmp_path / "logs" / "rank-0.log"
    snowman = "☃".encode()
    append(log, b"a" + snowman[:1])
    assert list(follower.poll()) == []
    append(log, snowman[1:] + b"\n\xff\xfe bad\n")
    assert list(follower.poll()) == [LogLine(0, "a☃"), LogLine(0, "\ufffd\ufffd bad")]


def test_carriage_return_progress_bars(tmp_path):
    follower = RunFollower(tmp_path)
    log = tmp_path / "logs" / "rank-0.log"
    append(log, b" 10%\r 20%\r 3")
    assert list(follower.poll()) == [LogLine(0, " 20%", progress=True)]
    assert list(follower.poll()) == []  # unchanged: not repeated
    append(log, b"0%\r100%\r\n")
    assert list(follower.poll()) == [LogLine(0, "100%")]


def test_metrics_and_launcher_log(tmp_path):
    follower = RunFollower(tmp_path)
    append(tmp_path / "metrics.jsonl", json.dumps({"epoch": 1, "loss": 0.5}).encode() + b"\n{broken\n")
    append(tmp_path / "logs" / "launcher.log", b"from torchrun\n")
    events = list(follower.poll())
    assert LogLine(None, "from torchrun") in events
    assert MetricsEvent({"epoch": 1, "loss": 0.5}) in events
    assert len(events) == 2
    assert list(RunFollower(tmp_path, include_launcher=False).poll())[0] == MetricsEvent({"epoch": 1, "loss": 0.5})
