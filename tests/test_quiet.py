"""QuietStream: tracebacks once and in notebook terms, a peer's consequent failure folded, warnings once."""

from nbddp.job.rank_output import QuietStream
from nbddp.contracts.sourcemap import Segment, SourceMap
from nbddp.job.follow import LogLine, MetricsEvent, RunFollower
from nbddp.contracts.rundir import RunDir
from tests.test_stream import GLUED, append

SCRIPT = "/runs/x/train.py"
SOURCE_MAP = SourceMap("nb.ipynb", "train.py", (Segment(script_start=20, length=10, cell=3, cell_line=1, role="train"),))
TRACEBACK = [
    "[rank1]: Traceback (most recent call last):",
    f'[rank1]:   File "{SCRIPT}", line 24, in <module>',
    "[rank1]:     raise ValueError('boom')",
    "[rank1]: ValueError: boom",
]
PEER = [
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "/site-packages/torch/distributed/distributed_c10d.py", line 5356, in barrier',
    "[rank0]:     work.wait()",
    "[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:41394. This is typically caused by a "
    "remote worker crashing. GLHF!",
]


def shown(events):
    return [(e.rank, e.text, e.every_rank) for e in events if isinstance(e, LogLine)]


def test_a_rank_traceback_is_shown_once_translated_without_torchs_prefix():
    quiet = QuietStream(SOURCE_MAP, [0, 1])
    held = quiet.feed([LogLine(1, "before")] + [LogLine(1, t) for t in TRACEBACK], now=0.0)
    assert shown(held) == [(1, "before", False)]  # the traceback waits for the line that ends it
    out = shown(quiet.feed([LogLine(1, "after")], now=0.1))
    assert out == [
        (1, "Traceback (most recent call last):", False),
        (1, f'  File "{SCRIPT}", line 24 [nb.ipynb, cell 3, line 5], in <module>', False),
        (1, "    raise ValueError('boom')", False),
        (1, "ValueError: boom", False),
        (1, "after", False),
    ]


def test_a_chained_traceback_stays_one_block_and_a_lone_one_is_let_go_after_the_hold():
    quiet = QuietStream(SOURCE_MAP, [0, 1], hold=1.0)
    lines = ["Traceback (most recent call last):", "  File \"a.py\", line 1, in f", "KeyError: 'x'", "",
             "During handling of the above exception, another exception occurred:", "",
             "Traceback (most recent call last):", "  File \"a.py\", line 3, in f", "ValueError: y"]
    assert shown(quiet.feed([LogLine(0, t) for t in lines], now=0.0)) == []
    assert shown(quiet.feed([], now=0.5)) == []
    assert [t for _, t, _ in shown(quiet.feed([], now=1.6))] == lines  # nothing lost, nothing split


def test_the_peers_connection_closed_traceback_becomes_one_line_after_the_real_one():
    quiet = QuietStream(SOURCE_MAP, [0, 1])
    events = [LogLine(0, t) for t in PEER] + [LogLine(1, t) for t in TRACEBACK]
    out = shown(quiet.feed(events, final=True, now=0.0))
    assert [t for r, t, _ in out if r == 1][-1] == "ValueError: boom"
    assert out[-1] == (0, "stopped by RuntimeError: Connection closed by peer (another rank failed or went away first)",
                       False)
    assert not any("GLHF" in t or "distributed_c10d" in t for _, t, _ in out)


def test_a_warning_every_rank_prints_is_shown_once_in_order():
    quiet = QuietStream(SOURCE_MAP, [0, 1])
    warning = [f"{SCRIPT}:13: UserWarning: careful", "  warnings.warn('careful')"]
    out = shown(quiet.feed([LogLine(0, "start 0"), *(LogLine(0, t) for t in warning), LogLine(0, "go 0"),
                            LogLine(1, "start 1"), *(LogLine(1, t) for t in warning), LogLine(1, "go 1")], now=0.0))
    assert out[:2] == [(0, "start 0", False), (1, "start 1", False)]  # every rank's earlier lines come first
    assert out[2:4] == [(0, warning[0], True), (0, warning[1], True)]
    assert sorted(out[4:]) == [(0, "go 0", False), (1, "go 1", False)]


def test_a_warning_whose_message_spans_lines_is_one_warning():
    quiet = QuietStream(SOURCE_MAP, [0, 1])
    warning = ["/site/catalyst/metric.py:86: UserWarning: Converting a tensor with requires_grad=True to a scalar",
               "Consider using tensor.detach() first. (Triggered internally at python_variable_methods.cpp:822.)",
               "  self.additive_metric.update(float(value), batch_size)"]
    out = shown(quiet.feed([LogLine(r, t) for r in (0, 1) for t in warning], now=0.0))
    assert out == [(0, t, True) for t in warning]


def test_a_warning_only_one_rank_prints_is_shown_as_its_own_after_the_hold():
    quiet = QuietStream(SOURCE_MAP, [0, 1], hold=1.0)
    warning = f"{SCRIPT}:13: UserWarning: only me"
    assert shown(quiet.feed([LogLine(0, warning), LogLine(0, "next")], now=0.0)) == []
    assert shown(quiet.feed([], now=1.5)) == [(0, warning, False), (0, "next", False)]


def test_other_events_pass_through():
    quiet = QuietStream(None, [0])
    metrics = MetricsEvent({"loss": 1.0})
    events = [metrics, LogLine(None, "launcher says"), LogLine(0, "x", progress=True)]
    assert quiet.feed(events) == events


def test_torchs_warning_glued_to_a_progress_bar_is_shown_once_for_every_rank_without_its_prefix(tmp_path):
    """The bytes two ranks wrote (a C++ warning while tqdm's bar held the line), followed and quietened as a run does."""
    for rank in (0, 1):
        append(tmp_path / "logs" / f"rank-{rank}.log",
               GLUED.replace(b"rank 0/2", f"rank {rank}/2".encode()).replace(b"[rank0]:", f"[rank{rank}]:".encode())
               .replace(b"23.384552090", b"23.384552090" if rank == 0 else b"23.400858476"))  # each its own time
    quiet = QuietStream(SOURCE_MAP, [0, 1])
    out = shown(quiet.feed(RunFollower(RunDir(tmp_path)).poll(final=True), final=True, now=0.0))
    warnings = [line for line in out if "find_unused_parameters=True" in line[1]]
    assert warnings == [(0, "[W1125 16:48:23.384552090 reducer.cpp:1529] Warning: find_unused_parameters=True was "
                            "specified in DDP constructor, but did not find any unused parameters in the forward pass. "
                            "(function operator())", True)], out
    assert out.index(warnings[0]) > max(out.index((r, f"[nbddp] rank {r}/2 started (pid 11078)", False)) for r in (0, 1))
    assert sorted(line for line in out if line[1] == "trained") == [(0, "trained", False), (1, "trained", False)]


def test_a_cpp_warning_only_one_rank_prints_is_its_own_and_lines_after_it_are_not_part_of_it():
    quiet = QuietStream(SOURCE_MAP, [0, 1], hold=1.0)
    warning = "[W1125 16:48:23.384552090 ProcessGroupGloo.cpp:12] Warning: only me (function f)"
    assert shown(quiet.feed([LogLine(0, f"[rank0]:{warning}"), LogLine(0, "next")], now=0.0)) == []
    assert shown(quiet.feed([], now=1.5)) == [(0, warning, False), (0, "next", False)]
