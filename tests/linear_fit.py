"""A tiny deterministic DDP training whose result a single process can compute exactly.

With plain SGD and no shuffling, ``W`` ranks × batch ``b`` average the same gradients as one
process with batch ``W × b``: the trained weights must match to float tolerance.
"""

from __future__ import annotations

import torch

SETUP = ("#| ddp\nimport time, torch, nbddp\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\n"
         "X = torch.linspace(-1, 1, 64 * 4).reshape(64, 4)\n"
         "Y = (X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])).squeeze(1)")
EPOCHS = 3


def train_cell(batch_per_rank: int) -> str:
    return ("#| ddp-train\n"
            "ddp_model = nbddp.prepare(model)\n"
            f"loader = nbddp.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size={batch_per_rank}))\n"
            "opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05)\n"
            f"for epoch in range({EPOCHS}):\n"
            "    for x, y in loader:\n"
            "        opt.zero_grad()\n"
            "        ((ddp_model(x).squeeze(1) - y) ** 2).mean().backward()\n"
            "        opt.step()\n"
            "    print('epoch', epoch, 'rank', nbddp.rank(), 'of', nbddp.world_size(), flush=True)")


EVALUATE = "print('kernel sees weight sum', round(float(model.weight.sum()), 5))"


def reference(batch: int) -> dict[str, torch.Tensor]:
    """The same training in this process, with the whole world's batch."""
    namespace: dict = {}
    exec(SETUP.replace("#| ddp\n", ""), namespace)
    model, X, Y = namespace["model"], namespace["X"], namespace["Y"]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(EPOCHS):
        for x, y in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=batch):
            opt.zero_grad()
            ((model(x).squeeze(1) - y) ** 2).mean().backward()
            opt.step()
    return model.state_dict()


def assert_matches(weights_path, batch: int) -> None:
    trained = torch.load(weights_path, weights_only=True)["returns"]["model"]
    for key, value in reference(batch).items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6)


def resumable_train_cell(batch_per_rank: int, seconds_per_epoch: float, epochs: int = EPOCHS) -> str:
    """:func:`train_cell`, resuming from ``nbddp.restore`` and saving a checkpoint after every epoch
    (slowed down, so a test can requeue or time out a job between two saves). :func:`reference` is
    the result of the default ``epochs`` only."""
    return ("#| ddp-train\n"
            "ddp_model = nbddp.prepare(model)\n"
            f"loader = nbddp.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size={batch_per_rank}))\n"
            "opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05)\n"
            "done = nbddp.restore(model=model, optimizer=opt)\n"
            f"for epoch in range(done.get('epoch', -1) + 1, {epochs}):\n"
            "    for x, y in loader:\n"
            "        opt.zero_grad()\n"
            "        ((ddp_model(x).squeeze(1) - y) ** 2).mean().backward()\n"
            "        opt.step()\n"
            f"    time.sleep({seconds_per_epoch})\n"
            "    print('epoch', epoch, 'rank', nbddp.rank(), 'attempt', nbddp.restart_count(), flush=True)\n"
            "    nbddp.save_checkpoint(model=model, optimizer=opt, epoch=epoch)")
