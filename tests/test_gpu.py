"""What only a GPU shows: NCCL's warm ranks (after a failure, an interrupt, a rank that can't leave), weights
from a GPU rank in the CPU kernel, ``--shard`` with mixed precision and CPU offload, CUDA's peak memory,
``torch.compile`` on warm ranks, a kernel that initialised CUDA itself, ``nbddp doctor``'s NCCL all-reduce.

Every test here is ``gpu`` and ``slow``: skipped where torch sees no GPU (tests/conftest.py), run on a GPU
machine by ``python3 -m pytest -m "gpu or not slow"`` with the fast tier. One GPU is all they need: ``--gpus
1``, world size 1 under NCCL (two ranks cannot share a GPU under NCCL). The same behaviour on CPU ranks
(gloo, 2 ranks) is tested in tests/test_warm.py, tests/test_magic.py and tests/test_sharding.py.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.conftest import code, wait_until, write_notebook
from tests.test_magic import ProtocolKernel, run_dirs
from tests.test_warm import pids

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(600)]
#: Kernels here start the warm ranks' starter at %load_ext, as users' do (tests/conftest.py).
PREPARES_AHEAD = True

SETUP = """#| ddp
import os, time, torch, nbddp
from torch import nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
X = torch.randn(64, 4)
y = X.sum(1, keepdim=True)"""
TRAIN = """%%ddp_train --gpus 1{flags}
ddp = nbddp.prepare(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
x, t = X.to(nbddp.device()), y.to(nbddp.device())
for epoch in range(3):
    loss = nn.functional.mse_loss(ddp(x), t)
    opt.zero_grad(); loss.backward(); opt.step()
{extra}print('trained with', torch.distributed.get_backend(), 'on', next(ddp.parameters()).device, flush=True)
print('RANK WEIGHTS', repr(torch.cat([p.detach().flatten() for p in model.parameters()]).cpu().tolist()), flush=True)"""
KERNEL_WEIGHTS = ("print('KERNEL WEIGHTS', repr(torch.cat([p.detach().flatten() for p in model.parameters()])"
                  ".tolist()), 'on', model.weight.device)")
#: A job that trains until it is interrupted (Python between GPU steps: an interrupt reaches it at once).
UNTIL_INTERRUPTED = ("for step in range(100000):\n    ddp(x).sum().backward()\n"
                     "    if step == 0:\n        print('looping', flush=True)\n    time.sleep(0.01)\n")
#: A job stuck in C code: ~40 s of one GPU kernel, waited for by cudaDeviceSynchronize, which no interrupt ends
#: (``spinning`` once the kernel is launched: the next thing the rank does is wait for it).
STUCK_IN_CUDA = "torch.cuda._sleep(1 << 36)\nprint('spinning', flush=True)\ntorch.cuda.synchronize()\n"


@pytest.fixture
def kernel(tmp_path):
    session = ProtocolKernel(tmp_path, timeout=300)
    session.execute("%load_ext nbddp")
    session.execute(SETUP, "setup")
    yield session
    session.close()


def train(kernel, flags: str = "", extra: str = "") -> str:
    return kernel.execute(TRAIN.format(flags=f" {flags}" if flags else "", extra=extra), "train")


def weights(text: str, label: str) -> list[float]:
    """The weights a rank (``RANK WEIGHTS``) or the kernel (``KERNEL WEIGHTS``) printed."""
    found = re.search(rf"{label} (\[[^\]]*\])", text)
    assert found, text
    return json.loads(found.group(1))


def kernel_weights(kernel) -> list[float]:
    out = kernel.execute(KERNEL_WEIGHTS)
    assert re.search(r"KERNEL WEIGHTS \[.*\] on cpu", out), out  # the kernel's model stays on the CPU
    return weights(out, "KERNEL WEIGHTS")


def wall_times(folder) -> list[float]:
    return [json.loads((d / "result.json").read_text())["wall_time_s"] for d in run_dirs(folder)]


def wait_for_rank_line(folder, text: str, timeout: float = 120) -> None:
    """Until rank 0 of the latest run has printed ``text``."""

    def printed() -> bool:
        dirs = run_dirs(folder)
        log = dirs[-1] / "logs" / "rank-0.log" if dirs else None
        return log is not None and log.exists() and text in log.read_text(errors="replace")

    wait_until(printed, timeout, f"rank 0 printed {text!r}")


# ---------------------------------------------------------------- a shared GPU server: --gpus free, --wait

TINY_SETUP = "#| ddp\nimport torch, nbddp\nmodel = torch.nn.Linear(2, 1)"
TINY_TRAIN = "#| ddp-train\nnbddp.prepare(model)\nprint('trained')"
#: Another user's job: a process computing on the GPU (a CUDA context and 1 GiB), until its stdin closes.
HOLDER = ("import sys, torch\nheld = torch.ones(2**28, device='cuda')\nprint('holding', flush=True)\n"
          "sys.stdin.read()\n")


def test_gpus_free_refuses_a_gpu_another_process_computes_on_and_wait_takes_it_once_freed(tmp_path, cli_run):
    """With a real process on the GPU (NVML lists it): ``--gpus free`` refuses in one line naming who holds what
    and how to wait, exit 3; ``--gpus 1 --wait`` says what it waits for and trains once that process is gone.

    First in this file: the in-process tests below give pytest's own process a CUDA context, which NVML
    lists on the GPU as one more process (the GPU is then rightly busy to ``--gpus free``)."""
    import subprocess
    import sys

    from nbddp.contracts.devices import gpu_usage, visible_usage

    (mine,) = visible_usage(gpu_usage())[:1]
    assert not mine.busy, f"the GPU is in use before the test: {mine.describe()}"
    write_notebook(tmp_path / "m.ipynb", [code(TINY_SETUP), code(TINY_TRAIN)])
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        refused = cli_run(["run", "m.ipynb", "--gpus", "free"], tmp_path)
        assert refused.wait() == 3, refused.output
        assert re.search(rf"--gpus free: 0 of the 1 visible GPUs are free \(GPU {mine.index}: 1 process, "
                         r"[\d.]+ of [\d.]+ GiB used\)\. Wait for 1 GPU to be free: --gpus 1 --wait; or use --cpu\.",
                         refused.output), refused.output
        assert not run_dirs(tmp_path) and not refused.leftovers()  # refused before anything started
        waiting = cli_run(["run", "m.ipynb", "--gpus", "1", "--wait"], tmp_path)
        waiting.wait_for("waiting for 1 GPU to be free (--wait)")
        time.sleep(2)
        assert waiting.proc.poll() is None and not run_dirs(tmp_path)  # still waiting: the GPU is still held
    finally:
        holder.stdin.close()
        holder.wait(60)
    assert waiting.wait() == 0, waiting.output
    assert f"training on the free GPU {mine.index}" in waiting.output and "[rank 0] trained" in waiting.output
    assert not waiting.leftovers()


# ---------------------------------------------------------------- weights, and a kernel that used CUDA


def test_the_doctor_on_a_gpu_all_reduces_with_nccl_and_names_its_versions(tmp_path, cli_run):
    run = cli_run(["doctor", "--gpus", "1", "--json"], tmp_path)
    code_ = run.wait(120)
    report = json.loads(run.output[run.output.index("{"):])
    found = {check["check"]: check for check in report["checks"]}
    assert code_ == 0 and report["ok"], run.output
    assert report["run"] == "1 GPU (NCCL) on this machine"
    assert found["versions"]["found"]["nccl"] and found["versions"]["found"]["driver"], found["versions"]
    assert found["allreduce"]["line"].startswith("a 1-rank all-reduce (nccl) took ")
    assert re.fullmatch(r"\d+ visible; the run's 1 \(\d+\) free", found["gpus"]["line"]), found["gpus"]
    assert report["seconds"] < 10  # (the bound on a healthy machine)
    assert not run.leftovers()


def test_a_gpu_ranks_weights_come_back_into_the_cpu_kernel_exactly(kernel):
    out = train(kernel)
    assert "succeeded in" in out and "model loaded on the CPU" in out, out
    assert "[rank 0] trained with nccl on cuda:0" in out, out
    assert weights(out, "RANK WEIGHTS") == kernel_weights(kernel)  # the values the GPU rank had, bit for bit


def test_a_kernel_that_initialised_cuda_still_trains_on_fresh_gpu_ranks(tmp_path):
    """The kernel holds a CUDA context (forking it would break CUDA in the child): the ranks are spawned, so
    its training runs, and the weights come back into its CPU model."""
    kernel = ProtocolKernel(tmp_path, timeout=300)
    try:
        kernel.execute("%load_ext nbddp")
        touched = kernel.execute("import torch\nkept = torch.ones(1, device='cuda')\n"
                                 "print('CUDA', torch.cuda.is_initialized())")
        assert "CUDA True" in touched, touched
        kernel.execute(SETUP, "setup")
        out = train(kernel)
        assert "succeeded in" in out and "[rank 0] trained with nccl on cuda:0" in out, out
        assert weights(out, "RANK WEIGHTS") == kernel_weights(kernel)
        again = train(kernel, "--fresh")  # ranks of its own, started from this kernel too
        assert "succeeded in" in again and "on a warm rank" not in again, again
    finally:
        kernel.close()


def test_the_starter_loaded_with_the_extension_holds_no_gpu_and_the_first_gpu_run_takes_under_5s(tmp_path):
    """``%load_ext nbddp`` starts the warm ranks' starter, which imports torch but never initialises CUDA (no
    context, no GPU memory: ``nvidia-smi`` doesn't list it); the first run forks its ranks from it, each then
    initialising CUDA and NCCL itself, in under 5 s (issue 46's bound on one H100)."""
    import subprocess

    import psutil

    kernel = ProtocolKernel(tmp_path, timeout=300)
    try:
        kernel.execute("%load_ext nbddp")
        starter = int(re.search(r"starter \(pid (\d+)\)", kernel.execute("%ddp_ranks")).group(1))
        wait_until(lambda: "has imported torch" in kernel.execute("%ddp_ranks"), 60,
                   "the warm ranks' starter has imported torch (%ddp_ranks)", every=0.5)
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.split()
        assert str(starter) not in apps, apps
        kernel.execute(SETUP, "setup")
        out = train(kernel)
        assert "succeeded in" in out and "[rank 0] trained with nccl on cuda:0" in out, out
        assert all(psutil.Process(pid).ppid() == starter for pid in pids(out).values())
        assert wall_times(tmp_path)[0] < 5.0, wall_times(tmp_path)
    finally:
        kernel.close()


# ---------------------------------------------------------------- NCCL's warm ranks


def test_nccl_warm_ranks_outlive_a_failed_and_an_interrupted_run_and_rerun_fast(kernel, tmp_path):
    first = train(kernel)
    started, reference = pids(first), kernel_weights(kernel)
    assert len(started) == 1 and "on a warm rank" not in first, first

    failed = train(kernel, extra="raise ValueError('boom')\n")
    assert "rank 0 raised ValueError: boom" in failed, failed
    after = train(kernel)
    assert "the last run failed: on the same warm ranks, in a new process group" in after, after
    assert pids(after) == started and kernel_weights(kernel) == pytest.approx(reference, rel=1e-6, abs=1e-7)

    kernel.start_execute(TRAIN.format(flags="", extra=UNTIL_INTERRUPTED), "train")
    wait_for_rank_line(tmp_path, "looping")
    interrupted_at = time.monotonic()
    kernel.km.interrupt_kernel()  # the stop button
    out = kernel.finish_execute()
    assert "the run was interrupted after" in out, out
    assert time.monotonic() - interrupted_at < 5
    after = train(kernel)
    assert "the last run was interrupted: on the same warm ranks, in a new process group" in after, after
    assert pids(after) == started and kernel_weights(kernel) == pytest.approx(reference, rel=1e-6, abs=1e-7)
    walls = wall_times(tmp_path)
    assert walls[-1] < walls[0] / 2, walls  # no torchrun, interpreter, CUDA or NCCL start: the first run paid those


def test_an_nccl_rank_that_cant_leave_within_3s_is_replaced_as_the_run_ends(kernel, tmp_path):
    started = pids(train(kernel))
    reference = kernel_weights(kernel)
    kernel.start_execute(TRAIN.format(flags="", extra=STUCK_IN_CUDA), "train")
    wait_for_rank_line(tmp_path, "spinning")  # in cudaDeviceSynchronize now
    interrupted_at = time.monotonic()
    kernel.km.interrupt_kernel()
    out = kernel.finish_execute()
    assert "the run was interrupted after" in out, out
    # CUDA's synchronize spins on the CPU: judged by its stack, which doesn't move (3 s), not by its CPU time (30 s)
    assert time.monotonic() - interrupted_at < 5, out
    described = kernel.execute("%ddp_ranks")
    assert "0 run(s)" in described, described  # the replacements, started as the run ended
    again = train(kernel)
    assert re.search(r"the last run was interrupted and its warm ranks could not be kept \(rank 0 couldn't leave the "
                     r"job: in synchronize at __init__\.py:\d+, from the %%ddp_train cell, line 10\): on fresh ones, "
                     r"started as it ended", again), again  # named with where it was: CUDA's synchronize, the cell's line
    assert not set(pids(again).values()) & set(started.values())
    assert kernel_weights(kernel) == pytest.approx(reference, rel=1e-6, abs=1e-7)


def test_torch_compile_on_warm_ranks_compiles_once_per_rank_not_per_run(tmp_path, monkeypatch):
    """The 2nd run of a compiled model on the same warm ranks finds its compiled kernels in the rank's caches."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold cache, and none left behind
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no pool of compile workers beside the rank
    kernel = ProtocolKernel(tmp_path, timeout=600)
    try:
        kernel.execute("%load_ext nbddp")
        kernel.execute(SETUP, "setup")
        compiled = TRAIN.replace("ddp = nbddp.prepare(model)\n", "ddp = torch.compile(nbddp.prepare(model))\n")
        first = kernel.execute(compiled.format(flags="", extra=""), "train")
        assert "succeeded in" in first, first
        reference = kernel_weights(kernel)
        second = kernel.execute(compiled.format(flags="", extra=""), "train")
        assert "succeeded in" in second and "on a warm rank (its run 2)" in second, second
        assert kernel_weights(kernel) == pytest.approx(reference, rel=1e-5, abs=1e-6)
        walls = wall_times(tmp_path)
        assert walls[1] < walls[0] / 2, walls
    finally:
        kernel.close()


GPU_SETUP = """#| ddp
import os, torch, nbddp
from torch import nn
device = 'cuda' if os.environ.get('WORLD_SIZE') else 'cpu'  # a rank's GPU (the kernel runs this cell on its CPU)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
X = torch.randn(300_000, 4, device=device)  # a dataset moved to the GPU (4.8 MB: checked, not copied)
y = X.sum(1, keepdim=True)"""
GPU_TRAIN = """%%ddp_train --gpus 1
ddp = nbddp.prepare(model)
opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
noise = torch.rand(1, device=X.device)  # CUDA's generator, where the setup left it
for _ in range(3):
    loss = nn.functional.mse_loss(ddp(X[:4096] + noise), y[:4096])
    opt.zero_grad(); loss.backward(); opt.step()
{extra}print('RANK WEIGHTS', repr(torch.cat([p.detach().flatten() for p in model.parameters()]).cpu().tolist()), flush=True)"""


def test_a_setup_on_the_gpu_is_kept_and_a_rerun_is_a_fresh_runs_bit_for_bit(tmp_path):
    """The warm state on a GPU rank: a model and a dataset the setup moved to the GPU are kept (the parameters'
    copies on the CPU), CUDA's random generator starts where the setup left it, a dataset changed on the GPU
    (in place, or through .data: the GPU checksum) runs the setup again, %ddp_ranks shows GPU memory, and a
    --fresh run's ranks get the GPU memory the warm ranks held."""
    kernel = ProtocolKernel(tmp_path, timeout=300)
    try:
        kernel.execute("%load_ext nbddp")
        kernel.execute(GPU_SETUP, "setup")
        first = kernel.execute(GPU_TRAIN.format(extra=""), "train")
        assert "ran; kept for the next run" in first, first
        reference = weights(first, "RANK WEIGHTS")
        again = kernel.execute(GPU_TRAIN.format(extra=""), "train")
        assert re.search(r"\[nbddp\] setup: In \[\d+\] kept\n", again) and weights(again, "RANK WEIGHTS") == reference
        shown = kernel.execute("%ddp_ranks")
        assert re.search(r"X [\d.]+ MB GPU", shown) and "nbddp's copies" in shown, shown
        fresh = kernel.execute(GPU_TRAIN.format(extra="").replace("--gpus 1", "--gpus 1 --fresh"), "train")
        assert "the warm ranks dropped the setup they kept (" in fresh and weights(fresh, "RANK WEIGHTS") == reference
        assert "ran; kept for the next run" in kernel.execute(GPU_TRAIN.format(extra=""), "train")  # (dropped: runs again)
        for change in ("X.mul_(2)\n", "X.data.mul_(2)\n"):
            kernel.execute(GPU_TRAIN.format(extra=change), "train")
            after = kernel.execute(GPU_TRAIN.format(extra=""), "train")
            assert "ran again: the last run changed X in place" in after, after
            assert weights(after, "RANK WEIGHTS") == reference
        assert "dropped the setup" in kernel.execute("%ddp_ranks forget")
        assert "nothing kept" in kernel.execute("%ddp_ranks")
    finally:
        kernel.close()


# ---------------------------------------------------------------- sharding, memory


SHARDED = """#| ddp-train
net = nbddp.prepare(model, mixed_precision=torch.bfloat16, offload=True)
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
r, w = nbddp.rank(), nbddp.world_size()
for step in range({steps}):
    x, t = X[r::w].to(nbddp.device()), Y[r::w].to(nbddp.device())
    loss = nn.functional.mse_loss(net(x).float(), t)
    opt.zero_grad(); loss.backward(); opt.step()
print('kind', type(net).__name__, 'shards on', next(net.parameters()).device, flush=True)"""


def test_sharded_with_mixed_precision_and_cpu_offload_gives_whole_float32_weights_on_the_cpu(tmp_path, cli_run):
    import torch

    from tests.test_sharding import EVALUATE, STEPS, reference
    from tests.test_sharding import SETUP as SHARD_SETUP

    write_notebook(tmp_path / "s.ipynb", [code(SHARD_SETUP), code(SHARDED.format(steps=STEPS)), code(EVALUATE)])
    run = cli_run(["run", "s.ipynb", "--gpus", "1", "--shard"], tmp_path)
    assert run.wait() == 0, run.output
    assert "[rank 0] kind FSDPSequential shards on cpu" in run.output  # offloaded between uses
    assert "kernel loss" in run.output and not run.leftovers()
    (run_dir,) = run_dirs(tmp_path)
    trained = torch.load(run_dir / "weights.pt", weights_only=True)["returns"]["model"]
    one = reference()  # the same training in one process, in float32 on the CPU
    assert trained.keys() == one.keys()
    for key, value in one.items():
        assert trained[key].device.type == "cpu" and trained[key].dtype == torch.float32, key
        assert trained[key].shape == value.shape, key  # whole, not a shard
        torch.testing.assert_close(trained[key], value, rtol=0, atol=3e-2)  # computed in bfloat16
    assert any(not torch.equal(trained[k], v) for k, v in one.items())  # mixed precision did run


MEMORY = [code("#| ddp\nimport torch, nbddp\nmodel = torch.nn.Linear(2, 1)"),
          code("#| ddp-train\nnbddp.prepare(model)\n"
               "held = torch.ones(512 * 2**20, dtype=torch.uint8, device='cuda')  # 512 MiB on the GPU\n"
               "print('held', held.numel(), held.device, flush=True)")]


def test_a_gpu_ranks_peak_memory_is_cudas_and_a_cpu_ranks_is_its_rss(tmp_path, cli_run):
    """result.json's peak_memory is CUDA's peak allocated memory on a GPU rank; a ``--cpu`` rank whose code
    touched CUDA all the same reports its resident memory (its work was on the CPU)."""
    write_notebook(tmp_path / "m.ipynb", MEMORY)
    gpu = cli_run(["run", "m.ipynb", "--gpus", "1", "--run-dir", "gpu"], tmp_path)
    assert gpu.wait() == 0, gpu.output
    cpu = cli_run(["run", "m.ipynb", "--cpu", "--nproc", "1", "--run-dir", "cpu"], tmp_path)
    assert cpu.wait() == 0, cpu.output
    assert "[rank 0] held 536870912 cuda:0" in gpu.output and "peak memory" in gpu.output
    for folder, kind in (("gpu", "cuda"), ("cpu", "rss")):
        report = json.loads((tmp_path / folder / "ranks" / "memory-0.json").read_text())
        peak = json.loads((tmp_path / folder / "result.json").read_text())["peak_memory"]
        assert report["kind"] == kind and set(peak) == {"0"}, (folder, report, peak)
    assert 512 * 2**20 <= json.loads((tmp_path / "gpu" / "result.json").read_text())["peak_memory"]["0"] < 2**30
    assert not gpu.leftovers() and not cpu.leftovers()


# ---------------------------------------------------------------- in this process (a GPU rank's policies)


def test_a_gpu_ranks_memory_report_is_cudas(tmp_path, monkeypatch):
    import torch

    from nbddp.rank_side import memory

    monkeypatch.delenv("NBDDP_DEVICE", raising=False)  # a rank of a GPU run (NBDDP_DEVICE=cuda says the same)
    held = torch.ones(64 * 2**20, dtype=torch.uint8, device="cuda")
    memory.watch(tmp_path / "memory-0.json", 0, fresh=True)
    try:
        report = json.loads((tmp_path / "memory-0.json").read_text())
    finally:
        memory.watch(None)
    assert report["kind"] == "cuda" and report["peak_bytes"] >= held.numel()


def test_a_lightning_trainer_on_a_gpu_rank_gets_the_gpu(monkeypatch, capsys):
    from nbddp.rank_side.frameworks import _lightning_kwargs

    monkeypatch.delenv("NBDDP_DEVICE", raising=False)
    for name, value in {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    kwargs = {"strategy": "fsdp", "devices": 8, "accelerator": "cpu"}  # a name: made this run's device
    _lightning_kwargs(kwargs)  # FSDP is refused on CPU ranks only
    assert kwargs == {"strategy": "fsdp", "devices": 1, "num_nodes": 1, "accelerator": "gpu"}
    assert "(1 per node, gpu), started by torchrun" in capsys.readouterr().out

