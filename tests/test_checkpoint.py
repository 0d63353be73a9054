"""Returned weights: atomic writes, safe CPU loads, clear errors."""

import os
import subprocess
import sys

import pytest
import torch

from nbddp.contracts.checkpoint import load_into, load_returns, save_returns
from nbddp.contracts.errors import CheckpointError
from tests.conftest import wait_until


def test_round_trip_strips_ddp_prefix_and_loads_into_kernel_objects(tmp_path):
    model = torch.nn.Linear(3, 2)
    wrapped = torch.nn.DataParallel(model)  # same `.module` stripping as DDP (on a GPU machine: moved to cuda:0)
    path = save_returns({"model": wrapped, "scale": 2.5}, tmp_path / "w.pt", note="final")
    states, note = load_returns(path)
    assert note == "final" and set(states["model"]) == {"weight", "bias"}
    assert {t.device.type for t in states["model"].values()} == {"cpu"}  # saved from whichever device trained it
    fresh = {"model": torch.nn.Linear(3, 2), "scale": 1.0}
    assert load_into(fresh, states) == ["model", "scale"]
    assert fresh["model"].weight.device.type == "cpu"
    torch.testing.assert_close(fresh["model"].weight, model.weight.detach().cpu())
    assert fresh["scale"] == 2.5


def test_weights_pt_loads_as_the_readme_says_with_torch_alone(tmp_path):
    """README, "Using weights.pt without nbddp": ``torch.load(..., weights_only=True)["returns"][NAME]``."""
    model = torch.nn.Linear(3, 2)
    save_returns({"model": torch.nn.DataParallel(model), "w_true": torch.ones(3)}, tmp_path / "weights.pt")
    saved = torch.load(tmp_path / "weights.pt", map_location="cpu", weights_only=True)
    assert saved["nbddp"] == 1 and set(saved["returns"]) == {"model", "w_true"}
    plain = torch.nn.Linear(3, 2)
    plain.load_state_dict(saved["returns"]["model"])  # no "module." prefix: a plain model takes it
    torch.testing.assert_close(plain.weight, model.weight.detach().cpu())  # (DataParallel moves it to a GPU)
    torch.testing.assert_close(saved["returns"]["w_true"], torch.ones(3))


def test_loaded_values_outlive_and_ignore_their_file(tmp_path):
    """Loading maps the file (mmap); what the kernel gets must not depend on it afterwards."""
    model, stats = torch.nn.Linear(3, 2), torch.arange(4.0)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    path = save_returns({"model": model, "optimizer": optimizer, "stats": stats}, tmp_path / "w.pt")
    fresh_model = torch.nn.Linear(3, 2)
    kernel = {"model": fresh_model, "optimizer": torch.optim.Adam(fresh_model.parameters()), "stats": None}
    load_into(kernel, load_returns(path)[0])
    import gc

    gc.collect()
    assert str(path) not in open("/proc/self/maps").read()  # nothing loaded is still pages of the file
    save_returns({"model": torch.nn.Linear(3, 2), "optimizer": optimizer, "stats": stats * 0}, path)  # replaced
    path.unlink()  # and then removed
    torch.testing.assert_close(kernel["model"].weight, model.weight)
    torch.testing.assert_close(kernel["stats"], torch.arange(4.0))
    kernel["stats"].add_(1)  # a loaded tensor is writable
    kernel["model"](torch.ones(1, 3)).sum().backward()
    kernel["optimizer"].step()  # and so is the optimizer's loaded state
    assert kernel["optimizer"].state_dict()["state"][0]["step"] == 2


def test_what_the_kernel_lacks_comes_back_as_saved_and_a_wrong_architecture_is_a_clear_error(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    states, _ = load_returns(save_returns({"model": model, "opt": opt, "w_true": torch.ones(2)}, tmp_path / "w.pt"))
    kernel = {"model": torch.nn.Linear(3, 2)}  # opt and w_true: made by a training cell, which the kernel doesn't run
    assert load_into(kernel, states) == ["model", "opt (as saved: the kernel had no opt to load it into)", "w_true"]
    assert kernel["opt"]["param_groups"][0]["lr"] == 0.1 and torch.equal(kernel["w_true"], torch.ones(2))
    with pytest.raises(CheckpointError, match="don't fit the notebook's 'model'"):
        load_into({"model": torch.nn.Linear(5, 2)}, states)


def test_what_isnt_weights_is_left_out_said_and_the_rest_comes_back(tmp_path):
    model = torch.nn.Linear(3, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 3)), batch_size=2)
    import collections

    import numpy

    path = save_returns({"model": model, "loader": loader, "history": {"loss": [0.5, 0.25], "best": None},
                         "counts": collections.defaultdict(list), "best": numpy.float64(0.25)},
                        tmp_path / "w.pt", note="final")
    states, note = load_returns(path)  # (a NumPy float saved would make the whole file refused)
    assert set(states) == {"model", "history", "counts"} and states["counts"] == {}  # a dict's state: a dict
    assert note == ("final; loader (a DataLoader), best (a float64) didn't come back: only modules, optimizers, "
                    "tensors and plain values (numbers, text, lists and dicts of them) do")


def test_truncated_or_tampered_files_are_refused(tmp_path):
    path = save_returns({"model": torch.nn.Linear(3, 2)}, tmp_path / "w.pt")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="refusing the checkpoint"):
        load_returns(path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"nbddp": 1, "returns": {"x": Evil()}}, path)
    with pytest.raises(CheckpointError, match="not plain weights"):
        load_returns(path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_returns(tmp_path / "missing.pt")


def test_failed_write_keeps_the_previous_checkpoint(tmp_path):
    """A file-size limit stands in for a full disk: the save fails, the old file survives."""
    path = save_returns({"model": torch.nn.Linear(2, 2)}, tmp_path / "w.pt")
    before = path.read_bytes()
    script = (
        "import resource, torch\nfrom nbddp.contracts.checkpoint import save_returns\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        f"save_returns({{'model': torch.nn.Linear(500, 500)}}, {str(path)!r})\n"
    )
    import signal

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGXFSZ, signal.SIG_IGN))
    assert done.returncode != 0
    assert f"could not write the checkpoint {path}" in done.stderr
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["w.pt"]  # no temp file left behind


def test_dying_mid_save_keeps_the_previous_checkpoint(tmp_path):
    """SIGKILL a writer while it saves, again and again: the file always loads, whole."""
    import signal
    import time

    path = tmp_path / "w.pt"
    writer = (
        "import torch, itertools\nfrom nbddp.contracts.checkpoint import save_returns\n"
        "for i in itertools.count():\n"
        f"    save_returns({{'model': {{'w': torch.full((2000, 2000), float(i))}}}}, {str(path)!r}, note=str(i))\n"
    )
    for delay in (0.0, 0.05, 0.3):
        proc = subprocess.Popen([sys.executable, "-c", writer])
        first = path.stat().st_mtime_ns if path.exists() else None

        def saved():
            if (path.stat().st_mtime_ns if path.exists() else None) != first:
                return True
            assert proc.poll() is None, "the writer exited before it saved"
            return False

        wait_until(saved, 120, "the writer saved", every=0.01)
        time.sleep(delay)  # not synchronisation: varies where in the next saves the kill lands
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if path.exists():
            states, note = load_returns(path)
            assert torch.equal(states["model"]["w"], torch.full((2000, 2000), float(note)))
    assert path.exists()
    save_returns({"model": {"w": torch.zeros(1)}}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["w.pt"]  # temp files of killed writers cleaned up
