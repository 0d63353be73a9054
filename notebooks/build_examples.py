"""Write the example notebooks (without outputs): ``python notebooks/build_examples.py``.

They are kept as code here so a change to them is a readable diff; the
committed ``.ipynb`` files are the executed versions (``nbddp run ... -o`` for
the tagged ones, ``papermill`` for the magic one).
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent

DATA = '''\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

torch.manual_seed(seed)
digits = load_digits()  # 1,797 8x8 images that ship with scikit-learn: no download
X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target)
X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.25, random_state=0, stratify=y)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))'''

EVALUATE = '''\
# Runs in the kernel, on the CPU, with the weights the ranks trained.
model.eval()
with torch.no_grad():
    accuracy = (model(X_test).argmax(dim=1) == y_test).float().mean().item()
print(f"test accuracy: {accuracy:.3f}")'''


def torch_notebook():
    return new_notebook(cells=[
        new_markdown_cell(
            "# Digits with plain PyTorch DDP\n\n"
            "Tagged cells become a DDP script: `parameters` and `#| ddp` cells run in every rank, "
            "the `#| ddp-train` cell trains under `torchrun`, untagged cells run only here.\n\n"
            "Run it: `nbddp run notebooks/digits_torch.ipynb` (all GPUs, or 2 CPU processes)."
        ),
        new_code_cell("epochs = 12\nlr = 0.05\nbatch_size = 32\nseed = 0", metadata={"tags": ["parameters"]}),
        new_code_cell("#| ddp\nimport nbddp\n" + DATA + "\ntrain_loader = DataLoader(TensorDataset(X_train, y_train), batch_size=batch_size, shuffle=True)"),
        new_code_cell("print(f\"{len(X_train)} training and {len(X_test)} test images\")"),
        new_code_cell(
            "#| ddp-train\n"
            "ddp_model = nbddp.prepare(model)         # DDP on this rank's device\n"
            "loader = nbddp.prepare(train_loader)     # each rank sees its own shard\n"
            "optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=0.9)\n"
            "loss_fn = nn.CrossEntropyLoss()\n"
            "for epoch in range(epochs):\n"
            "    total, count = 0.0, 0\n"
            "    for xb, yb in loader:\n"
            "        xb, yb = xb.to(nbddp.device()), yb.to(nbddp.device())\n"
            "        optimizer.zero_grad()\n"
            "        loss = loss_fn(ddp_model(xb), yb)\n"
            "        loss.backward()\n"
            "        optimizer.step()\n"
            "        total, count = total + loss.item() * len(yb), count + len(yb)\n"
            "    nbddp.log(epoch=epoch + 1, epochs=epochs, loss=total / count)\n"
            "    print(f\"epoch {epoch + 1} loss {total / count:.4f}\")"
        ),
        new_code_cell(EVALUATE),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


def catalyst_notebook():
    return new_notebook(cells=[
        new_markdown_cell(
            "# Digits with Catalyst's DistributedDataParallelEngine\n\n"
            "In the style of Catalyst's DDP tutorial: the `runner.train(...)` call stays as written; "
            "nbddp runs it with Catalyst's DDP engine across the devices.\n\n"
            "Run it: `nbddp run notebooks/digits_catalyst.ipynb`."
        ),
        new_code_cell("epochs = 8\nlr = 0.01\nbatch_size = 32\nseed = 0", metadata={"tags": ["parameters"]}),
        new_code_cell(
            "#| ddp\n" + DATA + "\nfrom catalyst import dl\n\n"
            "loaders = {\n"
            "    \"train\": DataLoader(TensorDataset(X_train, y_train), batch_size=batch_size, shuffle=True),\n"
            "    \"valid\": DataLoader(TensorDataset(X_test, y_test), batch_size=batch_size),\n"
            "}\n"
            "criterion = nn.CrossEntropyLoss()\n"
            "optimizer = torch.optim.Adam(model.parameters(), lr=lr)\n"
            "runner = dl.SupervisedRunner(input_key=\"features\", output_key=\"logits\", target_key=\"targets\", loss_key=\"loss\")"
        ),
        new_code_cell(
            "#| ddp-train\n"
            "runner.train(\n"
            "    model=model,\n"
            "    criterion=criterion,\n"
            "    optimizer=optimizer,\n"
            "    loaders=loaders,\n"
            "    num_epochs=epochs,\n"
            "    callbacks=[dl.AccuracyCallback(input_key=\"logits\", target_key=\"targets\", num_classes=10)],\n"
            "    logdir=\"./logs/digits_catalyst\",\n"
            "    valid_loader=\"valid\",\n"
            "    valid_metric=\"loss\",\n"
            "    minimize_valid_metric=True,\n"
            "    verbose=False,\n"
            ")"
        ),
        new_code_cell(EVALUATE),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


def magic_notebook():
    return new_notebook(cells=[
        new_markdown_cell(
            "# Digits with the `%%ddp_train` magic\n\n"
            "Train from inside Jupyter: `#| ddp` cells run here *and* in every rank; the `%%ddp_train` cell "
            "runs as a DDP job (all GPUs, or 2 CPU processes where there is none) while its live view shows "
            "progress, every rank's log and the metrics; then `model` holds the trained weights, on the CPU."
        ),
        new_code_cell("%load_ext nbddp"),
        new_code_cell("epochs = 12\nlr = 0.05\nbatch_size = 32\nseed = 0", metadata={"tags": ["parameters"]}),
        new_code_cell("#| ddp\nimport nbddp\n" + DATA + "\ntrain_loader = DataLoader(TensorDataset(X_train, y_train), batch_size=batch_size, shuffle=True)"),
        new_code_cell(
            "%%ddp_train\n"
            "ddp_model = nbddp.prepare(model)\n"
            "loader = nbddp.prepare(train_loader)\n"
            "optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=0.9)\n"
            "for epoch in range(epochs):\n"
            "    total, count = 0.0, 0\n"
            "    for xb, yb in loader:\n"
            "        xb, yb = xb.to(nbddp.device()), yb.to(nbddp.device())\n"
            "        optimizer.zero_grad()\n"
            "        loss = nn.functional.cross_entropy(ddp_model(xb), yb)\n"
            "        loss.backward()\n"
            "        optimizer.step()\n"
            "        total, count = total + loss.item() * len(yb), count + len(yb)\n"
            "    nbddp.log(epoch=epoch + 1, epochs=epochs, loss=total / count)\n"
            "    print(f\"epoch {epoch + 1} loss {total / count:.4f}\")"
        ),
        new_code_cell(EVALUATE),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


if __name__ == "__main__":
    for name, nb in [("digits_torch.ipynb", torch_notebook()), ("digits_catalyst.ipynb", catalyst_notebook()),
                     ("digits_magic.ipynb", magic_notebook())]:
        nbformat.validate(nb)
        nbformat.write(nb, HERE / name)
        print("wrote", HERE / name)
