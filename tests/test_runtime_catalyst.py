"""Catalyst 22.4 glue: engine configuration and the accelerate compatibility shim."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.extras import need

catalyst = need("catalyst")
from catalyst import dl  # noqa: E402

from nbddp import runtime_catalyst  # noqa: E402


def test_cpu_engine_uses_gloo_cpu_and_a_free_port_not_2112(monkeypatch):
    import os

    monkeypatch.setenv("NBDDP_DEVICE", "cpu")
    monkeypatch.setenv("NBDDP_NPROC", "2")
    monkeypatch.setenv("NBDDP_COLLECTIVE_TIMEOUT", "30")
    monkeypatch.setenv("MASTER_PORT", "")  # restored after the test: make_engine sets it
    monkeypatch.setenv("MASTER_ADDR", "")
    kwargs = runtime_catalyst.engine_kwargs()
    assert kwargs["cpu"] is True and kwargs["process_group_kwargs"]["backend"] == "gloo"
    assert kwargs["process_group_kwargs"]["timeout"].total_seconds() == 30
    assert kwargs["world_size"] == kwargs["num_node_workers"] == 2 and kwargs["address"] == "127.0.0.1"
    first = runtime_catalyst.make_engine()
    first_port = int(os.environ["MASTER_PORT"])
    second = runtime_catalyst.make_engine()
    assert isinstance(first, dl.DistributedDataParallelEngine) and isinstance(second, dl.DistributedDataParallelEngine)
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert 2112 not in (first_port, int(os.environ["MASTER_PORT"])) and first_port != int(os.environ["MASTER_PORT"])


def test_single_process_catalyst_metrics_work_with_the_shim():
    """accelerate renamed DistributedType.TPU; Catalyst's callbacks still read it outside DDP."""
    runtime_catalyst.apply_catalyst_shims()
    from accelerate.utils import DistributedType

    assert DistributedType.TPU is DistributedType.XLA
    X, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    loaders = {"train": DataLoader(TensorDataset(X, y), batch_size=8), "valid": DataLoader(TensorDataset(X, y), batch_size=8)}
    model = torch.nn.Linear(4, 3)
    runner = dl.SupervisedRunner()
    runner.train(model=model, criterion=torch.nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 loaders=loaders, num_epochs=1, engine=dl.CPUEngine(), verbose=False,
                 callbacks=[dl.AccuracyCallback(input_key="logits", target_key="targets", num_classes=3)])
    assert "accuracy01" in runner.loader_metrics
