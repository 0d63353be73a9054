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


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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
