"""Sharded training (FSDP2): the same notebook trains sharded or as DDP, with the same weights back.

The multi-process tests run real ``nbddp run`` / ``%%ddp_train`` jobs (torchrun, 2 gloo ranks, real
FSDP2 and ``torch.distributed.checkpoint``); the rest test the policies in this process.
"""

from __future__ import annotations

import ast
import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nbddp.contracts.errors import NbddpError, UsageError
from nbddp.rank_side import sharding
from tests.conftest import code, write_notebook

#: FSDP2 on CPU ranks needs torch 2.6 (nbddp.rank_side.sharding.cpu_shards): older torch refuses --shard there.
needs_cpu_shards = pytest.mark.skipif(not sharding.cpu_shards(), reason="FSDP2 on CPU ranks needs torch 2.6")


STEPS = 5
SETUP = """#| ddp
import torch, nbddp
from torch import nn
def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 1))
model = make_model()
X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
Y = X.sum(1, keepdim=True)"""
TRAIN = """#| ddp-train
net = nbddp.prepare(model{prepare})
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
r, w = nbddp.rank(), nbddp.world_size()
done = nbddp.restore(model=net, optimizer=opt)
for step in range(done.get('step', -1) + 1, {steps}):
    if step == 3 and {fail}:
        raise RuntimeError('transient failure')
    x, y = X[r::w], Y[r::w]
    loss = nn.functional.mse_loss(net(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    {save}
print('kind', type(net).__name__, 'attempt', nbddp.restart_count(), flush=True)"""
EVALUATE = "print('kernel loss', round(float(nn.functional.mse_loss(model(X), Y)), 6))"


def training(prepare: str = "", fail: str = "False", save: str = "pass", steps: int = STEPS) -> list:
    return [code(SETUP), code(TRAIN.format(prepare=prepare, fail=fail, save=save, steps=steps)), code(EVALUATE)]


def reference() -> dict[str, torch.Tensor]:
    """The same training in one process, with the whole batch."""
    namespace: dict = {}
    exec(SETUP.replace("#| ddp\n", ""), namespace)
    model, X, Y = namespace["model"], namespace["X"], namespace["Y"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(X), Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


def weights(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "weights.pt", weights_only=True)["returns"]["model"]


def run_dirs(folder):
    return sorted((folder / "runs").iterdir())


# ---------------------------------------------------------------- policies, in this process


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def test_blocks_are_the_outermost_repeated_submodules_or_what_the_user_says():
    stack = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    assert sharding.blocks_of(stack) == [stack[0], stack[2], stack[4]]  # ReLUs hold no parameters
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), num_layers=3, enable_nested_tensor=False)
    assert sharding.blocks_of(encoder) == list(encoder.layers)  # not the Linears inside them
    tower = nn.Sequential(Block(), Block(), nn.LayerNorm(4), nn.Linear(4, 2))
    # The head is a Linear, a repeated class (the blocks hold Linears): a unit of its own, as the blocks are.
    assert sharding.blocks_of(tower) == [tower[0], tower[1], tower[2], tower[3]]
    transformer = nn.Transformer(8, 2, 2, 2, 16, batch_first=True)  # containers (its ModuleLists, a Sequential) are looked into
    assert [type(b).__name__ for b in sharding.blocks_of(transformer)] == [
        "TransformerEncoderLayer", "TransformerEncoderLayer", "LayerNorm",
        "TransformerDecoderLayer", "TransformerDecoderLayer", "LayerNorm"]
    two_stacks = nn.Sequential(nn.Sequential(nn.Conv1d(4, 4, 1), nn.Conv1d(4, 4, 1)), nn.Sequential(nn.Linear(4, 4)))
    assert sharding.blocks_of(two_stacks) == [two_stacks[0][0], two_stacks[0][1]]  # not each whole stack
    headed = nn.Sequential(Block(), Block(), nn.Conv1d(4, 4, 1))
    assert sharding.blocks_of(headed) == [headed[0], headed[1]]  # a class that occurs once is the root's
    assert sharding.blocks_of(tower, nn.Linear) == [tower[0].inner, tower[1].inner, tower[3]]
    assert sharding.blocks_of(tower, lambda m: isinstance(m, nn.LayerNorm)) == [tower[0].norm, tower[1].norm, tower[2]]
    assert sharding.blocks_of(tower, [tower[1]]) == [tower[1]]
    with pytest.raises(NbddpError, match="not a submodule of the model being prepared"):
        sharding.blocks_of(tower, [nn.Linear(1, 1)])
    with pytest.raises(NbddpError, match="give a list of submodules, a module class or a function"):
        sharding.blocks_of(tower, 3)


def test_an_optimizers_state_by_name_becomes_its_state_by_position():
    by_name = {"state": {"a.weight": {"step": 1}, "b.bias": {"step": 2}},
               "param_groups": [{"lr": 0.1, "params": ["a.weight", "a.bias"]}, {"lr": 0.2, "params": ["b.bias"]}]}
    assert sharding.by_position(by_name) == {
        "state": {0: {"step": 1}, 2: {"step": 2}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}]}



@needs_cpu_shards
def test_an_optimizer_built_before_sharding_is_named_at_its_first_step(group):
    import nbddp

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded = nbddp.prepare(model, shard=True)
    assert sharding.is_sharded(sharded) and sharded is model
    sharded(torch.ones(1, 2)).sum().backward()
    with pytest.raises(NbddpError, match="SGD was built before nbddp.prepare.model, shard=True.*Build the optimizer after"):
        early.step()
    torch.optim.SGD(sharded.parameters(), lr=0.1).step()  # built after: fine
    with pytest.raises(NbddpError, match="sharded already"):
        nbddp.prepare(model, shard=True)


def stepped_sharded_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model sharded over this process's one-rank group, and its Adam after one step."""
    import nbddp

    torch.manual_seed(0)
    model = nbddp.prepare(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), shard=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    return model, opt


@needs_cpu_shards
def test_returned_sharded_models_and_optimizers_come_back_whole_and_load_into_plain_ones(group, tmp_path):
    """``--return model,opt``: what ``finish`` saves loads into the kernel's plain model and optimizer."""
    import nbddp
    from nbddp.contracts import checkpoint
    from nbddp.rank_side import torch_engine

    model, opt = stepped_sharded_model()
    values = torch_engine._gathered({"model": model, "opt": opt, "epochs": 3}, [model])
    checkpoint.save_returns(values, tmp_path / "weights.pt")
    states, _ = checkpoint.load_returns(tmp_path / "weights.pt")
    plain = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    kernel = {"model": plain, "opt": torch.optim.Adam(plain.parameters(), lr=0.1), "epochs": 0}
    assert checkpoint.load_into(kernel, states) == ["model", "opt", "epochs"]
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[key].full_tensor())
    assert kernel["epochs"] == 3 and set(kernel["opt"].state_dict()["state"]) == {0, 1, 2, 3}
    with pytest.raises(NbddpError, match="returned or saved without its model"):
        torch_engine._gathered({"opt": opt}, [])
    with pytest.raises(NbddpError, match="pass each sharded model by its own name"):
        nbddp.save_checkpoint(models={"a": model}, epoch=1)
    checkpoint.save_returns({"model": plain}, tmp_path / "resume.pt")  # as a DDP run's save_checkpoint
    with pytest.raises(Exception, match="saved by a run without sharding .DDP.; a sharded model can't resume"):
        nbddp.restore(tmp_path / "resume.pt", model=model)


@needs_cpu_shards
def test_a_sharded_checkpoint_restores_into_a_plain_model_without_a_process_group(group, tmp_path):
    """The kernel's case: DCP reads the shards into a model that was never sharded, with no group."""
    import nbddp
    from nbddp.contracts.rundir import RunDir
    from nbddp.rank_side import sharded_checkpoint

    model, opt = stepped_sharded_model()
    for note in ("attempt 0", "attempt 0"):  # a second save replaces the first
        sharded_checkpoint.save(RunDir(tmp_path), {"model": model, "optimizer": opt, "epoch": 7}, note)
    saves = sorted(p.name for p in (tmp_path / "resume.dcp").iterdir())
    assert len(saves) == 2 and saves[0] == "latest.json" and saves[1].endswith("-attempt0")
    assert json.loads((tmp_path / "resume.dcp" / "latest.json").read_text())["save"] == saves[1]
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    try:
        plain = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        plain_opt = torch.optim.Adam(plain.parameters(), lr=0.1)
        assert nbddp.restore(tmp_path, model=plain, optimizer=plain_opt) == {"epoch": 7}
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(value, full[key])
        assert plain_opt.state_dict()["state"][0]["step"] == 1
        with pytest.raises(Exception, match="no checkpoint in"):
            nbddp.restore(tmp_path / "elsewhere", model=plain)
        # DCP unpickles a save's .metadata: one another user wrote, or could change, is refused before torch reads it
        if os.geteuid() == 0:
            from nbddp.contracts.owned import NotYours

            metadata = tmp_path / "resume.dcp" / saves[1] / ".metadata"
            os.chown(metadata, 65534, 65534)
            with pytest.raises(NotYours, match=r"sharded checkpoint's file .*\.metadata belongs to uid 65534"):
                nbddp.restore(tmp_path, model=plain)
            os.chown(metadata, 0, 0)
            metadata.parent.chmod(0o777)
            with pytest.raises(NotYours, match="can be written by others"):
                nbddp.restore(tmp_path, model=plain)
    finally:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store2'}", rank=0, world_size=1)


def test_shard_is_a_launch_option_the_torch_engine_takes_and_catalyst_refuses(tmp_path):
    from nbddp.notebook.reader import read_notebook
    from nbddp.notebook.script import ExportOptions, generate
    from nbddp.plan.options import ArgumentParser, LaunchOptions, add_launch_arguments, launch_options

    parser = ArgumentParser(prog="nbddp run")
    add_launch_arguments(parser)
    options = launch_options(parser.parse_args(["--shard", "--cpu"]))
    assert options.shard and "--shard" in options.to_argv()
    assert launch_options(parser.parse_args(options.to_argv())) == options  # a batch's runs get it back
    assert options.export_options().shard
    with pytest.raises(UsageError, match="--shard needs the torch engine: Catalyst 22.4"):
        LaunchOptions(engine="catalyst", shard=True)
    catalyst = write_notebook(tmp_path / "c.ipynb", [
        code("#| ddp\nfrom catalyst import dl"),
        code("#| ddp-train\nrunner = dl.SupervisedRunner()\nrunner.train(model=model, loaders=loaders)")])
    with pytest.raises(UsageError, match="--shard needs the torch engine"):
        generate(read_notebook(catalyst), ExportOptions(shard=True))  # detected, not named


def test_the_exported_script_shows_the_fsdp_calls(tmp_path):
    from nbddp.notebook.reader import read_notebook
    from nbddp.notebook.script import ExportOptions, generate

    nb = read_notebook(write_notebook(tmp_path / "s.ipynb", training()))
    sharded = generate(nb, ExportOptions(shard=True)).text
    assert "_nbddp.start(shard=True)" in sharded and "s.ipynb --shard   (the whole notebook, training sharded)" in sharded
    assert "#         fully_shard(block, mesh=mesh)\n#     fully_shard(model, mesh=mesh)" in sharded
    assert "get_model_state_dict(model" in sharded
    plain = generate(nb, ExportOptions()).text
    assert "_nbddp.start()" in plain and "fully_shard" not in plain


def test_peak_memory_is_reported_read_and_said(tmp_path, as_cpu_rank):
    """A CPU rank's peak is its RSS, on a machine with GPUs too (even where this process used CUDA); a GPU
    rank's is CUDA's (tests/test_gpu.py)."""
    from nbddp.contracts.rank_memory import describe, read_peaks
    from nbddp.contracts.rundir import RunDir
    from nbddp.rank_side import memory

    memory.watch(tmp_path / "ranks" / "memory-1.json", 1, fresh=True)
    try:
        report = json.loads((tmp_path / "ranks" / "memory-1.json").read_text())
    finally:
        memory.watch(None)
    assert report["kind"] == "rss" and 10e6 < report["peak_bytes"] < 20e9
    (tmp_path / "ranks" / "memory-0.json").write_text(json.dumps({"peak_bytes": 1_234_000_000}))
    assert read_peaks(RunDir(tmp_path))[0] == 1_234_000_000 and list(read_peaks(RunDir(tmp_path))) == [0, 1]
    assert describe({0: 1_234_000_000, 1: 987_000_000}) == "peak memory 1.23 GB, 987 MB (ranks 0-1)"
    assert describe({}) == ""


def test_the_sharding_section_says_each_figure_and_what_sharding_bought():
    """benchmarks/sharding.py's report, from figures given here (the real ones take minutes: BENCHMARKS.md)."""
    from benchmarks.sharding import markdown

    figures = {"DDP": {"peak": [2.5, 2.4], "held": [1.6, 1.6], "rate": [0.5, 0.6]},
               "FSDP2 (--shard)": {"peak": [1.6, 1.6], "held": [0.8, 0.8], "rate": [0.2, 0.3]}}
    text = markdown(figures, 2, 5, 1.5, 2048, {"DDP": 14, "FSDP2 (--shard)": 35}, "python -m benchmarks.sharding")
    assert "| DDP | 2.45 (2.40–2.50) | 1.60 (1.60–1.60) | 0.55 (0.50–0.60) |" in text
    assert "Held state under FSDP2: 0.50× DDP's" in text and "| FSDP2 (--shard) | 35 layers | 147M |" in text
    assert "trains a 2.5× larger model in the same memory" in text


# ---------------------------------------------------------------- real runs


@needs_cpu_shards
@pytest.mark.slow
def test_a_sharded_run_gives_ddps_weights_and_one_processs_and_the_kernel_evaluates(tmp_path, cli_run):
    write_notebook(tmp_path / "s.ipynb", training())
    write_notebook(tmp_path / "mp.ipynb", training(prepare=", mixed_precision=torch.bfloat16"))
    ddp = cli_run(["run", "s.ipynb", "--cpu"], tmp_path)
    assert ddp.wait() == 0, ddp.output
    sharded = cli_run(["run", "s.ipynb", "--cpu", "--shard"], tmp_path)
    assert sharded.wait() == 0, sharded.output
    mixed = cli_run(["run", "mp.ipynb", "--cpu", "--shard"], tmp_path)
    assert mixed.wait() == 0, mixed.output
    assert "[rank 0] kind DistributedDataParallel" in ddp.output
    assert "[rank 0] kind FSDPSequential" in sharded.output and "[rank 1] kind FSDPSequential" in sharded.output
    ddp_dir, shard_dir = sorted(d for d in run_dirs(tmp_path) if d.name.startswith("s-"))
    (mp_dir,) = [d for d in run_dirs(tmp_path) if d.name.startswith("mp-")]
    one = reference()
    for key, value in one.items():
        torch.testing.assert_close(weights(shard_dir)[key], weights(ddp_dir)[key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weights(shard_dir)[key], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weights(mp_dir)[key], value, rtol=0, atol=3e-2)  # bfloat16 compute
    assert any(not torch.equal(weights(mp_dir)[k], v) for k, v in one.items())  # mixed precision did run
    ddp_loss = re.search(r"kernel loss ([\d.]+)", ddp.output).group(1)
    assert f"kernel loss {ddp_loss}" in sharded.output  # the kernel's model, loaded, evaluates the same
    result = json.loads((shard_dir / "result.json").read_text())
    assert set(result["peak_memory"]) == {"0", "1"} and all(v > 50e6 for v in result["peak_memory"].values())
    assert "peak memory" in sharded.output and not sharded.leftovers()


@needs_cpu_shards
@pytest.mark.beside  # long, asserting no timing: evens out .ci/run's lanes
@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_sharded_checkpoint_and_it_restores_at_world_size_one(tmp_path, cli_run):
    save = "nbddp.save_checkpoint(model=net, optimizer=opt, step=step)"
    write_notebook(tmp_path / "r.ipynb", training(save=save, fail="r == 1 and nbddp.restart_count() == 0"))
    run = cli_run(["run", "r.ipynb", "--cpu", "--shard", "--max-restarts", "1"], tmp_path)
    assert run.wait() == 0, run.output
    assert "[rank 1] [nbddp] attempt 2: resumed from resume.dcp/save-" in run.output
    assert "[rank 0] kind FSDPSequential attempt 1" in run.output
    (run_dir,) = run_dirs(tmp_path)
    trained = weights(run_dir)
    for key, value in reference().items():  # the uninterrupted run's weights
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6)
    assert json.loads((run_dir / "result.json").read_text())["restarts"] == 1
    saves = [p.name for p in (run_dir / "resume.dcp").iterdir()]
    assert len(saves) == 2 and "latest.json" in saves  # one save kept, the pointer to it
    # Saved by 2 ranks, each a shard; restored in a Jupyter kernel: one process, no process group.
    import nbformat
    from nbclient import NotebookClient

    restore = ("opt = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
               f"print('restored', nbddp.restore({str(run_dir)!r}, model=model, optimizer=opt))\n"
               "print('step', int(opt.state_dict()['state'][0]['step']))\n"
               "print(repr(torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()))")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(restore)])
    NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    said = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert f"restored {{'step': {STEPS - 1}}}" in said and f"step {STEPS}" in said, said
    in_kernel = torch.tensor(ast.literal_eval(said.strip().splitlines()[-1]))
    torch.testing.assert_close(in_kernel, torch.cat([v.flatten() for v in trained.values()]))
    assert not run.leftovers()


@needs_cpu_shards
@pytest.mark.slow
def test_two_nodes_over_loopback_train_sharded(tmp_path, cli_run):
    from tests.test_nodes import free_port, node_args, only_run_dir, two_folders

    node0, node1 = two_folders(tmp_path, "s.ipynb", training())
    port = free_port()
    other = cli_run(node_args("s.ipynb", 1, port, "--shard"), node1)
    main = cli_run(node_args("s.ipynb", 0, port, "--shard"), node0)
    assert main.wait() == 0, main.output
    assert other.wait() == 0, other.output
    assert "[rank 3] kind FSDPSequential" in other.output
    for key, value in reference().items():  # 4 ranks x 16 rows == 1 process x 64
        torch.testing.assert_close(weights(only_run_dir(node0))[key], value, rtol=1e-5, atol=1e-6)
    assert "kernel loss" in main.output
    assert not main.leftovers() and not other.leftovers()


@needs_cpu_shards
@pytest.mark.slow
def test_warm_ranks_switch_between_sharded_and_ddp_runs_with_fresh_run_weights(tmp_path):
    from tests.test_magic import ProtocolKernel

    kernel = ProtocolKernel(tmp_path)
    try:
        kernel.execute("%load_ext nbddp")
        kernel.execute(SETUP, "setup")
        body = TRAIN.replace("#| ddp-train\n", "").format(prepare="", fail="False", save="pass", steps=STEPS)
        state = "print(repr(torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()))"
        seen = []
        for flags in ("", " --shard", "", " --shard"):
            out = kernel.execute(f"%%ddp_train --cpu{flags}\n{body}", "train")
            assert ("kind FSDPSequential" in out) == bool(flags) and ("kind DistributedDataParallel" in out) != bool(flags), out
            if seen:
                assert "on a warm rank" in out  # the same ranks served every run
            if len(seen) == 2:  # FSDP2 made the kept model its own: the setup cell runs again (tests/test_warm_state.py)
                assert "ran again: the last run turned model into a FSDPSequential" in out, out
            seen.append(torch.tensor(ast.literal_eval(kernel.execute(state).strip())))
            kernel.execute("model = make_model()")  # each run starts from the same weights
        one = torch.cat([v.flatten() for v in reference().values()])
        for trained in seen:  # sharded after DDP, DDP after sharded: a fresh run's weights every time
            torch.testing.assert_close(trained, one, rtol=1e-5, atol=1e-6)
    finally:
        kernel.close()


MEMORY_SETUP = """#| ddp
import torch, nbddp
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)])  # 25.2M parameters: 0.4 GB of DDP state"""
MEMORY_TRAIN = """#| ddp-train
net = nbddp.prepare(model)
opt = torch.optim.Adam(net.parameters(), lr=1e-4)
loss = net(torch.randn(4, 2048)).square().mean()
loss.backward(); opt.step()
local = lambda t: t.to_local() if hasattr(t, 'to_local') else t
tensors = [local(p) for p in net.parameters()] + [local(p.grad) for p in net.parameters()]
tensors += [local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}  # views counted once
print('RESIDENT', nbddp.rank(), sum(storages.values()), flush=True)"""


@needs_cpu_shards
@pytest.mark.slow
def test_sharding_holds_at_most_six_tenths_of_ddps_state_per_rank(tmp_path, cli_run):
    """~25M parameters with Adam on 2 CPU ranks: parameters, gradients and optimizer state, measured in the rank."""
    write_notebook(tmp_path / "big.ipynb", [code(MEMORY_SETUP), code(MEMORY_TRAIN)])
    measured = {}
    for flag in ("", "--shard"):
        run = cli_run(["run", "big.ipynb", "--cpu", *([flag] if flag else [])], tmp_path)
        assert run.wait(timeout=300) == 0, run.output
        resident = {int(r): int(b) for r, b in re.findall(r"RESIDENT (\d) (\d+)", run.output)}
        assert len(resident) == 2 and not run.leftovers()
        measured[flag] = resident
    for rank in (0, 1):
        assert measured["--shard"][rank] <= 0.6 * measured[""][rank], measured
    ddp_dir, shard_dir = sorted(run_dirs(tmp_path))
    ddp_peak = json.loads((ddp_dir / "result.json").read_text())["peak_memory"]
    shard_peak = json.loads((shard_dir / "result.json").read_text())["peak_memory"]
    assert all(shard_peak[r] < ddp_peak[r] for r in ("0", "1")), (shard_peak, ddp_peak)


def test_shard_on_cpu_ranks_before_torch_2_6_is_refused_in_one_line(monkeypatch):
    """torch 2.4's FSDP2 calls into CUDA even for CPU shards (a CUDA error on a machine without a GPU): refused,
    saying what to do, instead of that error from deep inside torch."""
    monkeypatch.setattr(torch, "__version__", "2.4.1+cpu")
    assert not sharding.cpu_shards()
    with pytest.raises(NbddpError, match=r"^--shard on CPU ranks needs torch 2.6 or newer \(this is torch 2.4.1\+cpu"):
        sharding.shard(nn.Linear(2, 2), torch.device("cpu"))
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    assert sharding.cpu_shards()
