"""The in-rank API, in a single process (no launcher) and in a 1-process gloo group."""

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import nbddp


def test_single_process_returns_objects_unchanged():
    model = torch.nn.Linear(2, 2)
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2)
    assert nbddp.prepare(model) is model and nbddp.prepare(loader) is loader
    assert (nbddp.rank(), nbddp.world_size(), nbddp.is_main()) == (0, 1, True)
    with pytest.raises(TypeError, match="nn.Module or a DataLoader"):
        nbddp.prepare([1, 2])


def test_log_without_run_dir_prints(capsys, monkeypatch):
    monkeypatch.delenv("NBDDP_RUN_DIR", raising=False)
    nbddp.log(epoch=1, loss=torch.tensor(0.5))
    assert "[nbddp.log] epoch=1 loss=0.5" in capsys.readouterr().out



def test_prepared_loader_keeps_settings_and_advances_the_epoch(group):
    collate = lambda batch: torch.stack([b[0] for b in batch])  # noqa: E731
    loader = DataLoader(TensorDataset(torch.arange(20.0)), batch_size=4, shuffle=True, drop_last=True,
                        collate_fn=collate, pin_memory=False)
    prepared = nbddp.prepare(loader)
    assert (prepared.batch_size, prepared.drop_last, prepared.collate_fn) == (4, True, collate)
    assert isinstance(prepared.sampler, torch.utils.data.DistributedSampler) and prepared.sampler.shuffle
    first = torch.cat(list(prepared))
    second = torch.cat(list(prepared))
    assert prepared.sampler.epoch == 1
    assert sorted(first.tolist()) == sorted(second.tolist()) == [float(i) for i in range(20)]
    assert first.tolist() != second.tolist()  # a new shuffle each epoch


def test_prepared_model_is_ddp(group):
    wrapped = nbddp.prepare(torch.nn.Linear(2, 2))
    assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)



def test_leave_group_keeps_the_final_barrier_alive_until_exit(tmp_path, monkeypatch, as_cpu_rank):
    """The teardown abort's fix: the last barrier's work is never released by a gloo thread.

    (The race itself needs a busy machine, ~1 run in 10 there; the soak test shows it gone. This
    checks the mechanism: the barrier ran, its work is held past shutdown, the group is gone.)
    """
    import sys

    from nbddp.rank_side import process as rank_process

    keep, kept = rank_process._keep_until_exit, []
    monkeypatch.setattr(rank_process, "_keep_until_exit", lambda work: (kept.append(work), keep(work)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    ddp = nbddp.prepare(torch.nn.Linear(2, 2))
    ddp(torch.randn(3, 2)).sum().backward()  # DDP's all-reduce, queued from inside backward()
    rank_process.leave_group()
    assert not dist.is_initialized()
    (work,) = kept
    kept.clear()
    assert work.is_completed()
    assert sys.getrefcount(work) == 3  # `work` here, getrefcount's argument, and the one kept until exit
    rank_process.leave_group()  # no group any more: nothing to do


def test_no_submodule_shadows_the_api_of_training_cells():
    """``nbddp.rank()`` etc. must stay functions once every submodule is imported (a module named
    ``nbddp.rank`` once replaced it, and every rank failed with 'module' object is not callable)."""
    import importlib
    import pkgutil

    import papermill  # noqa: F401 - nbddp.doors.papermill is papermill's plug-in: papermill loads it, once imported
    for module in pkgutil.walk_packages(nbddp.__path__, "nbddp."):
        if module.name == "nbddp.__main__":
            continue  # runs the command
        importlib.import_module(module.name)
    for name in nbddp._RUNTIME:
        assert callable(getattr(nbddp, name)) and not isinstance(getattr(nbddp, name), type(nbddp)), name


def test_the_training_codes_own_destroy_process_group_leaves_the_group_safely(tmp_path, monkeypatch, as_cpu_rank):
    """`dist.barrier(); dist.destroy_process_group()` at the end of a training cell: the final barrier
    before the destroy is kept until exit too (the teardown race of any barrier)."""
    import torch.distributed.distributed_c10d as c10d

    from nbddp.rank_side import process as rank_process

    monkeypatch.setattr(dist, "destroy_process_group", dist.destroy_process_group)  # undone after the test
    monkeypatch.setattr(c10d, "destroy_process_group", c10d.destroy_process_group)
    keep, kept = rank_process._keep_until_exit, []
    monkeypatch.setattr(rank_process, "_keep_until_exit", lambda work: (kept.append(work), keep(work)))
    rank_process.guard_destroy()
    rank_process.guard_destroy()  # idempotent
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    ddp = nbddp.prepare(torch.nn.Linear(2, 2))
    ddp(torch.randn(3, 2)).sum().backward()
    dist.barrier()
    dist.destroy_process_group()
    assert not dist.is_initialized() and len(kept) == 1 and kept[0].is_completed()
    rank_process.leave_group()  # nothing left to leave
    assert len(kept) == 1


@pytest.mark.parametrize("warm, frozen", [("", "True"), ("1", "False")])
def test_a_rank_about_to_exit_skips_the_final_collection_but_a_warm_rank_never_does(warm, frozen):
    """Interpreter shutdown's collection over torch's objects is ~0.3 s of a rank's exit, which the kernel waits
    for; a warm rank runs more jobs, whose garbage must still be collected."""
    import os
    import subprocess
    import sys

    # Compared with the count before: Python 3.12 starts with objects in the permanent generation (375 of them),
    # 3.11 and 3.13 with none.
    probe = ("import gc\nfrom nbddp.rank_side.process import skip_final_collection\nbefore = gc.get_freeze_count()\n"
             "skip_final_collection()\nprint(gc.get_freeze_count() > before)")
    env = {k: v for k, v in os.environ.items() if k != "NBDDP_WARM"} | ({"NBDDP_WARM": warm} if warm else {})
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env, check=True)
    assert out.stdout.strip() == frozen, out.stderr


def test_a_gpu_ranks_group_is_bound_to_its_own_gpu_and_a_cpu_ranks_takes_no_device(tmp_path, monkeypatch):
    """NCCL gets ``device_id=cuda:LOCAL_RANK`` (no "barrier(): using the device under current context" warning,
    the communicator formed on that GPU); gloo none. NCCL can't run here: its arguments are checked against
    this torch's ``init_process_group``, and the gloo ones by joining a real group as a ``--cpu`` rank (gloo on
    a GPU machine too: tests/test_gpu.py joins NCCL's)."""
    import inspect

    from nbddp.rank_side import torch_engine

    nccl = torch_engine.group_backend(True, 3)
    assert nccl == {"backend": "nccl", "device_id": torch.device("cuda", 3)}
    inspect.signature(dist.init_process_group).bind(**nccl, store=None, rank=0, world_size=1)  # a parameter of it
    assert torch_engine.group_backend(False, 3) == {"backend": "gloo"}
    for version in ("2.4.1", "2.5.0+cu124", "2.7.1+cu128", "2.11.0+cu130", "2.13.0+cpu"):
        assert torch_engine.group_backend(True, 1, version)["device_id"] == torch.device("cuda", 1), version
    for version in ("2.6.0", "2.6.0+cu124", "2.7.0+cu126"):  # NCCL hangs in a bound group there (pytorch#153960)
        assert torch_engine.group_backend(True, 1, version) == {"backend": "nccl"}, version
    monkeypatch.setenv("NBDDP_DEVICE", "cpu")
    torch_engine.join_group(dist.FileStore(str(tmp_path / "store"), 1), 0, 1)
    try:
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_a_rank_started_beyond_the_gpus_ends_in_one_line_exit_3_recorded(tmp_path):
    """torchrun --nproc_per_node 2 on one GPU: local rank 1 says so before its first CUDA call (which would die
    with "invalid device ordinal"), and its error is recorded as any rank's. The GPU count is the one fake
    (this machine has no GPU); the rank's check, its message, the record and the exit are real."""
    import json
    import os
    import subprocess
    import sys

    probe = ("import torch\ntorch.cuda.device_count = lambda: 1  # one GPU (a fake: none here)\n"
             "from nbddp.rank_side import torch_engine\ntorch_engine.own_gpu()\nprint('not reached')")
    env = dict(os.environ, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               NBDDP_RUN_DIR=str(tmp_path))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 3 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr == ("nbddp: error: local rank 1 has no GPU: 2 processes were started on this machine, one per "
                           "GPU, and torch sees 1 GPU here. Start 1, one per GPU: torchrun --nproc_per_node 1, or "
                           "nbddp run --gpus 1 (or 2 CPU processes: nbddp run --cpu --nproc 2).\n")
    report = json.loads((tmp_path / "errors" / "rank-1.json").read_text())
    assert report["type"] == "DeviceError" and report["message"] in done.stderr and report["rank"] == 1
