"""Following rank logs: partial lines, \\r progress bars, bad bytes, metrics."""

import json

import pytest

from nbddp.job.follow import LogLine, MetricsEvent, RunFollower
from nbddp.contracts.rundir import RunDir


def append(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(data)


def test_lines_arrive_as_written_and_partial_lines_wait(tmp_path):
    follower = RunFollower(RunDir(tmp_path))
    log = tmp_path / "logs" / "rank-1.log"
    append(log, b"first\nsec")
    assert list(follower.poll()) == [LogLine(1, "first")]
    append(log, b"ond\n")
    assert list(follower.poll()) == [LogLine(1, "second")]
    append(log, b"no newline at the end")
    assert list(follower.poll()) == []
    assert list(follower.poll(final=True)) == [LogLine(1, "no newline at the end")]


def test_utf8_split_across_writes_and_invalid_bytes(tmp_path):
    follower = RunFollower(RunDir(tmp_path))
    log = tmp_path / "logs" / "rank-0.log"
    snowman = "☃".encode()
    append(log, b"a" + snowman[:1])
    assert list(follower.poll()) == []
    append(log, snowman[1:] + b"\n\xff\xfe bad\n")
    assert list(follower.poll()) == [LogLine(0, "a☃"), LogLine(0, "\ufffd\ufffd bad")]


def test_carriage_return_progress_bars(tmp_path):
    follower = RunFollower(RunDir(tmp_path))
    log = tmp_path / "logs" / "rank-0.log"
    append(log, b" 10%\r 20%\r 3")
    assert list(follower.poll()) == [LogLine(0, " 20%", progress=True)]
    assert list(follower.poll()) == []  # unchanged: not repeated
    append(log, b"0%\r100%\r\n")
    assert list(follower.poll()) == [LogLine(0, "100%")]


def test_metrics_and_launcher_log(tmp_path):
    follower = RunFollower(RunDir(tmp_path))
    append(tmp_path / "metrics.jsonl", json.dumps({"epoch": 1, "loss": 0.5}).encode() + b"\n{broken\n")
    append(tmp_path / "logs" / "launcher.log", b"from torchrun\n")
    events = list(follower.poll())
    assert LogLine(None, "from torchrun") in events
    assert MetricsEvent({"epoch": 1, "loss": 0.5}) in events
    assert len(events) == 2
    assert list(RunFollower(RunDir(tmp_path), include_launcher=False).poll())[0] == MetricsEvent({"epoch": 1, "loss": 0.5})


#: What rank 0 of a DDP model with ``find_unused_parameters=True`` wrote while ``tqdm(range(3))`` ran (torch 2.13):
#: torch's C++ warning came while tqdm's bar held the line open.
GLUED = (b"[nbddp] rank 0/2 started (pid 11078)\n"
         b"\r  0%|          | 0/3 [00:00<?, ?it/s][rank0]:[W1125 16:48:23.384552090 reducer.cpp:1529] Warning: "
         b"find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters in "
         b"the forward pass. (function operator())\n"
         b"\r 33%|\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x8e      | 1/3 [00:00<00:00,  4.53it/s]"
         b"\r100%|\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88"
         b"\xe2\x96\x88\xe2\x96\x88| 3/3 [00:00<00:00,  4.75it/s]\ntrained\n")


@pytest.mark.parametrize("chunk", [len(GLUED), 7])  # all at once, and as a slow rank writes it
def test_a_line_written_after_a_progress_bars_state_is_a_line_of_its_own(tmp_path, chunk):
    follower = RunFollower(RunDir(tmp_path))
    events = []
    for start in range(0, len(GLUED), chunk):
        append(tmp_path / "logs" / "rank-0.log", GLUED[start:start + chunk])
        events += follower.poll()
    lines = [e.text for e in events if not e.progress]
    assert lines == [
        "[nbddp] rank 0/2 started (pid 11078)",
        "[rank0]:[W1125 16:48:23.384552090 reducer.cpp:1529] Warning: find_unused_parameters=True was specified in "
        "DDP constructor, but did not find any unused parameters in the forward pass. (function operator())",
        "100%|██████████| 3/3 [00:00<00:00,  4.75it/s]",
        "trained",
    ]
    assert LogLine(0, "  0%|          | 0/3 [00:00<?, ?it/s]", progress=True) in events  # the bar, as a bar


def test_a_bar_padded_over_a_longer_state_and_bars_without_a_total(tmp_path):
    follower = RunFollower(RunDir(tmp_path))
    append(tmp_path / "logs" / "rank-1.log",
           b"\r10it [00:01, 9.50it/s, loss=0.3]   /x.py:3: UserWarning: w\n"  # tqdm pads a shorter state
           b"\rdone [00:01] not a bar's timing\n")
    assert [(e.text, e.progress) for e in follower.poll()] == [
        ("10it [00:01, 9.50it/s, loss=0.3]", True), ("/x.py:3: UserWarning: w", False),
        ("done [00:01] not a bar's timing", False)]
