"""Warm state: on warm ranks a re-run runs only the setup cells that changed (and the ones after them), and its
training still starts from the state a fresh run's setup leaves, bit for bit.

Real kernels (raw execute requests, as JupyterLab sends them), real torchrun, 2 gloo ranks (``--cpu``). The
weights each run brings back are compared by their bytes with those of the first run (on fresh warm ranks)
and of a ``--fresh`` run (ranks started for it alone).
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.test_magic import ProtocolKernel, run_dirs

pytestmark = pytest.mark.slow
#: Kernels here start the warm ranks' starter at %load_ext, as users' do (tests/conftest.py).
PREPARES_AHEAD = True

#: What a training cell found when it started, and the bytes of the weights it brought back.
DIGEST = ("import hashlib\nprint('weights', hashlib.sha1(b''.join(p.detach().numpy().tobytes() "
          "for p in model.parameters())).hexdigest())")
SETUP_LINE = re.compile(r"\[rank 0\] \[nbddp\] (setup: .*)")


def setup_line(out: str) -> str:
    found = SETUP_LINE.findall(out)
    assert len(found) == 1, out
    return found[0]


def weights(kernel) -> str:
    return kernel.execute(DIGEST).split("weights ", 1)[1].strip()


def started(out: str) -> str:
    """The training's first line on rank 0: what it started from."""
    return re.search(r"\[rank 0\] start (.*)", out).group(1)


def wall(tmp_path) -> float:
    return json.loads((run_dirs(tmp_path)[-1] / "result.json").read_text())["wall_time_s"]


@pytest.fixture
def kernel(tmp_path):
    session = ProtocolKernel(tmp_path)
    session.execute("%load_ext nbddp")
    yield session
    session.close()


def cell_label(kernel) -> str:
    return f"In [{kernel.count}]"


SLOW_SETUP = "#| ddp\nimport time, torch, nbddp\nfrom torch import nn\ntime.sleep(3)  # loading a dataset\nprint('SETUP RAN')"
MODEL_CELL = "#| ddp\ntorch.manual_seed(0)\nmodel = nn.Linear(4, 1)\nX = torch.randn(64, 4)\ny = X.sum(1, keepdim=True)"
TRAIN = ("%%ddp_train --cpu{flags}\nddp = nbddp.prepare(model)\nopt = torch.optim.SGD(ddp.parameters(), lr=lr)\n"
         "for _ in range(3):\n    loss = nn.functional.mse_loss(ddp(X), y)\n    opt.zero_grad(); loss.backward(); opt.step()\n")


def test_an_unchanged_setup_is_kept_and_an_edited_cell_runs_with_the_ones_after_it(kernel, tmp_path):
    """After a 3 s setup cell, an unchanged training cell re-runs in a fraction of a second (3.3 s before) with the
    first run's weights; a value only the training reads keeps the setup; an edited cell runs with the ones after it."""
    kernel.execute("lr = 0.1")  # a kernel value only the training reads
    kernel.execute(SLOW_SETUP, "slow")
    slow = cell_label(kernel)
    kernel.execute(MODEL_CELL, "model")
    model = cell_label(kernel)
    first = kernel.execute(TRAIN.format(flags=""), "train")
    assert setup_line(first) == f"setup: {slow}, {model} ran; kept for the next run" and "SETUP RAN" in first
    reference = weights(kernel)

    again = kernel.execute(TRAIN.format(flags=""), "train")
    assert setup_line(again) == f"setup: {slow}, {model} kept" and "SETUP RAN" not in again, again
    assert weights(kernel) == reference and wall(tmp_path) < 1.5  # (3.3 s before; ~0.3 s on an idle machine)
    walls = []  # the figure (≤ 0.3 s wanted on an idle 2-core machine): the best of four more re-runs,
    for _ in range(4):  # the whole cell as the kernel sees it, loosely bounded (the machine is shared)
        started_at = time.monotonic()
        kernel.execute(TRAIN.format(flags=""), "train")
        walls.append(time.monotonic() - started_at)
    assert min(walls) < 1.0 and weights(kernel) == reference, walls

    kernel.execute("lr = 0.2")  # read by the training only: the setup is kept
    assert setup_line(kernel.execute(TRAIN.format(flags=""), "train")) == f"setup: {slow}, {model} kept"
    changed_lr = weights(kernel)
    assert changed_lr != reference
    kernel.execute("lr = 0.1")

    kernel.execute(MODEL_CELL.replace("manual_seed(0)", "manual_seed(1)"), "model")  # an edited cell
    edited = kernel.execute(TRAIN.format(flags=""), "train")
    assert setup_line(edited) == f"setup: {slow} kept, {cell_label_after(edited)} ran (edited)", edited
    assert "SETUP RAN" not in edited and wall(tmp_path) < 3.0 and weights(kernel) != reference

    kernel.execute(SLOW_SETUP + "  # edited", "slow")  # the first cell: every cell runs
    slow_again = cell_label(kernel)
    first_edited = kernel.execute(TRAIN.format(flags=""), "train")
    assert setup_line(first_edited).startswith(f"setup: {slow_again}, ") and \
        setup_line(first_edited).endswith(f" ran ({slow_again} edited)"), first_edited
    assert "SETUP RAN" in first_edited

    fresh = kernel.execute(TRAIN.format(flags=" --fresh"), "train")  # ranks of its own: the whole setup, no line
    assert "SETUP RAN" in fresh and not SETUP_LINE.findall(fresh)
    fresh_weights = weights(kernel)
    assert setup_line(kernel.execute(TRAIN.format(flags=""), "train")).endswith(" kept")
    assert weights(kernel) == fresh_weights


def cell_label_after(out: str) -> str:
    return re.search(r"kept, (In \[\d+\]) ran", out).group(1)


#: Everything a training cell may do to what the setup made: train the model, step the setup's optimizer, draw
#: random numbers (torch, random, NumPy), change a small tensor in place, append to a list, set an attribute.
STATE_SETUP = """#| ddp
import random, numpy as np, torch, nbddp
from torch import nn
torch.manual_seed(0); random.seed(0); np.random.seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
X = torch.randn(64, 4)
y = X.sum(1, keepdim=True)
big = torch.zeros(300_000)  # 1.2 MB: checked, not copied
history = []
class Settings:
    pass
settings = Settings()
settings.scale = 1.0"""
STATE_TRAIN = """%%ddp_train --cpu
print('start', [float(model[0].weight.sum()), len(opt.state), float(torch.rand(1)), random.random(),
                float(np.random.rand()), float(X.sum()), float(big.sum()), len(history), settings.scale,
                hasattr(settings, 'seen'), model.training], flush=True)
ddp = nbddp.prepare(model)
for _ in range(3):
    loss = nn.functional.mse_loss(ddp(X * settings.scale + torch.rand(1)), y)
    opt.zero_grad(); loss.backward(); opt.step()
history.append(1); settings.scale *= 2; settings.seen = True; X.mul_(2); model.eval()
{extra}"""


def test_whatever_a_run_did_to_the_setup_the_next_one_starts_from_a_fresh_runs_state(kernel, tmp_path):
    kernel.execute(STATE_SETUP, "setup")
    label = cell_label(kernel)
    first = kernel.execute(STATE_TRAIN.format(extra=""), "train")
    start, reference = started(first), weights(kernel)

    again = kernel.execute(STATE_TRAIN.format(extra=""), "train")
    assert setup_line(again) == f"setup: {label} kept", again
    assert started(again) == start and weights(kernel) == reference

    fresh = kernel.execute(STATE_TRAIN.format(extra="").replace("--cpu", "--cpu --fresh"), "train")
    assert started(fresh) == start and weights(kernel) == reference

    # A big tensor (a dataset: checked, not copied) changed in place, seen by its version counter, and through
    # .data (no version counter sees it, its checksum does): the cell that made it runs again.
    for change in ("big.add_(1)", "big.data.add_(1)"):
        kernel.execute(STATE_TRAIN.format(extra=change), "train")
        after = kernel.execute(STATE_TRAIN.format(extra=""), "train")
        assert setup_line(after) == f"setup: {label} ran again: the last run changed big in place", after
        assert started(after) == start and weights(kernel) == reference
    assert setup_line(kernel.execute(STATE_TRAIN.format(extra=""), "train")) == f"setup: {label} kept"
    assert weights(kernel) == reference


def test_a_changed_value_or_local_module_runs_the_cells_that_read_it_and_tracebacks_name_kept_cells(kernel, tmp_path):
    (tmp_path / "helper.py").write_text("SCALE = 1.0\n")
    kernel.execute("n = 32")
    kernel.execute("#| ddp\nimport torch, nbddp\nfrom torch import nn\ntorch.manual_seed(0)\nmodel = nn.Linear(4, 1)\n"
                   "def check(x):\n    if x < 0:\n        raise ValueError('negative')", "first")
    first = cell_label(kernel)
    kernel.execute("#| ddp\nimport helper\nX = torch.randn(n, 4) * helper.SCALE\ny = X.sum(1, keepdim=True)", "data")
    data = cell_label(kernel)
    train = "%%ddp_train --cpu\nprint('rows', len(X), float(X.abs().sum()))\nddp = nbddp.prepare(model)\n"
    assert setup_line(kernel.execute(train, "train")).endswith("ran; kept for the next run")
    kernel.execute("n = 16")
    changed = kernel.execute(train, "train")
    assert setup_line(changed) == f"setup: {first} kept, {data} ran (n changed)" and "[rank 1] rows 16" in changed
    (tmp_path / "helper.py").write_text("SCALE = 0.0  # edited\n")
    edited = kernel.execute(train, "train")
    assert setup_line(edited) == f"setup: {first} kept, {data} ran (helper.py changed)", edited
    assert "[rank 0] rows 16 0.0" in edited

    # A function a kept cell defined fails in a later run whose script has the cells on other lines (a new
    # kernel value comes first): its traceback still names the cell and line it is on.
    kernel.execute("limit = -1")
    failed = kernel.execute(train + "check(limit)\n", "train")
    assert setup_line(failed) == f"setup: {first}, {data} kept", failed
    assert f"[{first}, line 8]" in failed and "ValueError: negative" in failed, failed


def test_ranks_show_and_forget_what_they_keep_and_say_why_something_cant_be_kept(kernel, tmp_path):
    kernel.execute("#| ddp\nimport torch, nbddp\nfrom torch import nn\ntorch.manual_seed(0)\nmodel = nn.Linear(100, 10)\n"
                   "data = torch.zeros(300_000)\nitems = []", "a")
    made = cell_label(kernel)
    kernel.execute("#| ddp\nitems.append(1)", "b")
    train = "%%ddp_train --cpu\nprint('items', items)\nnbddp.prepare(model)\n"
    kernel.execute(train, "train")
    shown = kernel.execute("%ddp_ranks")
    assert "2 warm ranks" in shown and shown.count(f"{made}, In [") == 2, shown  # each rank's cells
    assert "data 1.2 MB" in shown and "model 4.04 kB" in shown and "items" in shown, shown
    assert "nbddp's copies 4.04 kB (CPU)" in shown, shown  # the parameters are copied, the dataset is checked

    # An edited cell that changes in place what an earlier cell made runs that cell again too.
    kernel.execute("#| ddp\nitems.append(2)", "b")
    edited_label = cell_label(kernel)
    out = kernel.execute(train, "train")
    assert setup_line(out) == (f"setup: {made}, {edited_label} ran ({edited_label} edited; {edited_label} changes "
                               f"items in place, which {made} made)"), out
    assert "[rank 0] items [2]" in out

    assert "dropped the setup they kept" in kernel.execute("%ddp_ranks forget")
    assert "nothing kept" in kernel.execute("%ddp_ranks")
    assert setup_line(kernel.execute(train, "train")).endswith("ran; kept for the next run")

    # What can't be kept is said, and its cell runs every time.
    kernel.execute("#| ddp\nlog = open('setup.log', 'a')", "c")
    opened = cell_label(kernel)
    kernel.execute(train, "train")
    again = kernel.execute(train, "train")
    assert setup_line(again) == f"setup: {made}, {edited_label} kept, {opened} ran again: log (an open file) can't be kept"

    # A setup whose copies would not fit in memory is not kept, in a line; the next run runs it again.
    kernel.execute("#| ddp\nimport nbddp.rank_side.warm.kept_objects as kept\nkept.COPY_SHARE = 1e-12  # a full machine", "c")
    full = kernel.execute(train, "train")
    assert re.search(r"; not kept: copying what a run changes \(4.04 kB\) would not fit in memory \(.* free\)$",
                     setup_line(full)), full
    assert "nothing kept (copying what a run changes" in kernel.execute("%ddp_ranks")
    assert " ran; not kept: copying what a run changes (4.04 kB) would not fit" in setup_line(kernel.execute(train, "train"))


def test_a_setup_cell_that_failed_runs_again_and_the_cells_before_it_are_kept(kernel, tmp_path):
    kernel.execute(SLOW_SETUP, "slow")
    slow = cell_label(kernel)
    kernel.execute("#| ddp\nimport os\nif not os.path.exists('ready'):\n    raise RuntimeError('not ready')\nvalue = 1",
                   "check")
    check = cell_label(kernel)
    train = "%%ddp_train --cpu\nprint('value', value)\n"
    failed = kernel.execute(train, "train")
    assert "RuntimeError: not ready" in failed and setup_line(failed) == f"setup: {slow}, {check} ran", failed
    (tmp_path / "ready").touch()
    fixed = kernel.execute(train, "train")
    assert setup_line(fixed) == f"setup: {slow} kept, {check} ran (it didn't finish last time)", fixed
    assert "[rank 0] value 1" in fixed and "SETUP RAN" not in fixed


def test_a_compiled_model_trains_again_without_compiling_again(kernel, tmp_path, monkeypatch):
    """``torch.compile`` in setup: the compiled model is kept, the re-run compiles nothing (dynamo's frame count
    doesn't grow) and gives the first run's weights. Dynamo's ``aot_eager`` backend traces forward and backward
    as inductor does, without generating C++ (20 s of a 2-core machine); inductor on warm ranks is the gpu lane's
    (tests/test_gpu.py)."""
    kernel.execute("#| ddp\nimport time, torch, nbddp\nfrom torch import nn\nfrom torch._dynamo.utils import counters\n"
                   "torch.manual_seed(0)\nmodel = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), backend='aot_eager')\n"
                   "X = torch.randn(32, 8)\ny = X.sum(1, keepdim=True)", "setup")
    train = ("%%ddp_train --cpu\nddp = nbddp.prepare(model)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.01)\n"
             "for _ in range(5):\n    loss = nn.functional.mse_loss(ddp(X), y)\n    opt.zero_grad(); loss.backward(); opt.step()\n"
             "print('frames', counters['frames']['total'])\n")
    kernel.timeout = 600
    first = kernel.execute(train, "train")
    frames = re.search(r"\[rank 0\] frames (\d+)", first).group(1)
    reference = kernel.execute("print(float(model._orig_mod[0].weight.detach().sum()))")
    again = kernel.execute(train, "train")
    assert setup_line(again).endswith(" kept") and f"[rank 0] frames {frames}" in again, again
    assert kernel.execute("print(float(model._orig_mod[0].weight.detach().sum()))") == reference
    walls = [json.loads((d / "result.json").read_text())["wall_time_s"] for d in run_dirs(tmp_path)]
    assert walls[1] < walls[0] / 3, walls
