"""A rank's log is capped (nbddp/rank_side/log_cap.py): a rank that floods its output keeps its log's start and last
lines within ``--log-cap`` (plus a megabyte of tail), says so at the end, and an interrupt under the flood still
ends the cell within seconds.

Real runs: ``nbddp run`` and ``%%ddp_train`` in a real kernel (2 gloo ranks); the cut itself in a real process whose
fd 1 appends to a real file, a concurrent write of the rank's made at the one moment it could be lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from nbddp.rank_side.log_cap import TAIL
from tests.conftest import code, wait_until, write_notebook

FLOOD = ("#| ddp-train\nimport time\nt0 = time.time(); i = 0\nwhile time.time() - t0 < {seconds}:\n"
         "    print('flood line', i, 'x' * 80); i += 1\nprint('the end', i, flush=True)")


@pytest.mark.slow
def test_a_flooding_rank_keeps_its_start_and_last_lines_within_the_cap_and_says_what_it_dropped(tmp_path, cli_run):
    write_notebook(tmp_path / "f.ipynb", [code("import torch, nbddp", "ddp"), code(FLOOD.format(seconds=4))])
    run = cli_run(["run", "f.ipynb", "--cpu", "--log-cap", "1MB"], tmp_path)
    assert run.wait(timeout=180) == 0, run.output[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "result.json").read_text())
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_bytes()
        # the cap, its line, the tail, and what the rank wrote between two of its checks (a quarter second)
        assert 1_000_000 < len(log) <= 1_000_000 + TAIL + 3 * TAIL, len(log)
        assert log.startswith(b"[nbddp] rank") and b"flood line 0 " in log[:1000]  # its start
        assert log[:1_000_000].endswith(b"\n[nbddp] this log reached its cap of 1 MB (--log-cap): from here on "
                                        b"only the rank's last lines are kept, below.\n"), log[999_800:1_000_100]
        assert b"flood line " in log[1_000_000:1_000_200], log[1_000_000:1_000_200]  # its last lines after it
        assert log.rstrip().endswith(b"the end " + log.rstrip().rsplit(b" ", 1)[-1])  # and its last lines
        assert record["dropped_output"][str(rank)] > 1_000_000
        assert f"[rank {rank}] the end" in run.output  # the last lines reach the terminal once the rank has ended
    assert "] [nbddp] this log reached its cap of 1 MB (--log-cap)" in run.output  # ([all ranks] when both say it)
    assert "logs capped (--log-cap), output not kept: rank 0 " in run.output
    assert not run.leftovers()


@pytest.mark.slow
def test_an_interrupt_under_a_flood_of_output_ends_the_cell_within_seconds(tmp_path):
    """The stop button while both ranks print as fast as they can (the default cap, 100 MB): the cell ends with
    the interrupt within seconds (measured to the kernel's reply), the ranks kept warm for the next run."""

    from tests.test_magic import ProtocolKernel

    kernel = ProtocolKernel(tmp_path)
    try:
        kernel.execute("%load_ext nbddp")
        kernel.execute("#| ddp\nimport torch, nbddp", "setup")
        kernel.start_execute("%%ddp_train --cpu\n" + FLOOD.format(seconds=60).split("\n", 1)[1], "train")
        logs = tmp_path / "runs"

        def flooded() -> bool:
            found = list(logs.glob("*/logs/rank-1.log"))
            return bool(found) and found[0].stat().st_size >= 20_000_000

        wait_until(flooded, 120, "the ranks flooded (20 MB in rank 1's log)")
        stopped = time.monotonic()
        kernel.km.interrupt_kernel()  # the stop button
        out = kernel.finish_execute()
        # 1.4 s here alone, 2 s beside three busy loops; 5.8 s once with .ci/run's lanes at once on 2 cores, 13 s on
        # the project CI's slower machine (the test's own client then drains the kernel's messages slowly too).
        # What it guards: the cell ends in seconds, not once 100 MB of output has been drained (minutes).
        assert time.monotonic() - stopped < 30, time.monotonic() - stopped
        assert "KeyboardInterrupt" in out and "interrupted" in out
        again = kernel.execute("%%ddp_train --cpu\nprint('again', nbddp.rank())", "train")
        assert "[rank 1] again 1" in again and "on a warm rank (its run 2)" in again, again
    finally:
        kernel.close()


#: A process whose fd 1 appends to the log, as a rank's does; the rank's write lands while the cut reads the lines it
#: moves (the moment the old cut lost it: its truncation then dropped what was appended after its look at the size).
CUT_WHILE_THE_RANK_WRITES = """
import os, sys
from nbddp.rank_side import log_cap
kept, length = int(sys.argv[1]), os.fstat(1).st_size
read = os.pread
def pread_as_the_rank_writes(fd, n, offset):
    data = read(fd, n, offset)
    if pread_as_the_rank_writes.first:
        pread_as_the_rank_writes.first = False
        os.write(1, b"the rank's last line\\n")
    return data
pread_as_the_rank_writes.first = True
os.pread = pread_as_the_rank_writes
print(log_cap._keep_newest(kept, length, 275), file=sys.stderr)
"""


def test_the_cut_keeps_what_the_rank_writes_while_it_moves_the_newest_lines(tmp_path):
    head = b"h" * 99 + b"\n"
    lines = b"".join(b"line %03d %s\n" % (i, b"x" * 40) for i in range(100))  # 50 bytes each
    log = tmp_path / "rank-0.log"
    log.write_bytes(head + lines)
    with open(log, "ab") as appending:
        done = subprocess.run([sys.executable, "-c", CUT_WHILE_THE_RANK_WRITES, str(len(head))], stdout=appending,
                              stderr=subprocess.PIPE, text=True, check=True)
    newest = lines[-250:]  # the 275 bytes asked for start within a line: the 5 whole lines after it
    assert log.read_bytes() == head + newest + b"the rank's last line\n"
    assert int(done.stderr) == len(lines) - len(newest)


def test_a_log_whose_newest_bytes_end_no_line_is_cut_all_the_same(tmp_path):
    """A rank that writes no newline (a progress bar redrawn with \\r) still has its log cut: from the newest redraw
    it moved, else its last bytes as they are."""
    head = b"h" * 99 + b"\n"
    for written, kept in ((b"x" * 1000, b"x" * 275), (b"".join(b"\rstep %04d" % i for i in range(100)), None)):
        log = tmp_path / "rank-0.log"
        log.write_bytes(head + written)
        script = ("import sys; from nbddp.rank_side import log_cap; import os; "
                  "print(log_cap._keep_newest(int(sys.argv[1]), os.fstat(1).st_size, 275), file=sys.stderr)")
        with open(log, "ab") as appending:
            subprocess.run([sys.executable, "-c", script, str(len(head))], stdout=appending, check=True)
        tail = log.read_bytes()[len(head):]
        if kept is not None:
            assert tail == kept
        else:  # from the first redraw begun within the last 275 bytes: 27 of the 100, whole
            assert tail == written[-269:] and tail.startswith(b"step 0073")
