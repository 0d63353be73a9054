"""Write the example notebooks (without outputs): ``python notebooks/build_examples.py [NAME.ipynb...]``.

They are kept as code here so a change to them is a readable diff; the
committed ``.ipynb`` files are the executed versions (``nbddp run ... -o`` for
the tagged ones, ``papermill`` for the magic one).
"""

from pathlib import Path

import nbformat
from nbformat import NotebookNode
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


def torch_notebook() -> NotebookNode:
    return new_notebook(cells=[
        new_markdown_cell(
            "# Digits with plain PyTorch DDP\n\n"
            "Tagged cells become a DDP script: `parameters` and `#| ddp` cells run in every rank, "
            "the `#| ddp-train` cell trains under `torchrun`, untagged cells run only here.\n\n"
            "Run it: `nbddp run notebooks/digits_torch.ipynb` (all GPUs, or 2 CPU processes)."
        ),
        new_code_cell("epochs = 12\nlr = 0.05\nbatch_size = 32\nseed = 0", metadata={"tags": ["parameters"]}),
        new_code_cell("#| ddp\nimport nbddp\n" + DATA + "\ntrain_loader = DataLoader(TensorDataset(X_train, y_train), "
                      "batch_size=batch_size, shuffle=True)"),
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


def catalyst_notebook() -> NotebookNode:
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
            "runner = dl.SupervisedRunner(input_key=\"features\", output_key=\"logits\", target_key=\"targets\", "
            "loss_key=\"loss\")"
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


def magic_notebook() -> NotebookNode:
    return new_notebook(cells=[
        new_markdown_cell(
            "# Digits with the `%%ddp_train` magic\n\n"
            "Train from inside Jupyter: `#| ddp` cells run here *and* in every rank; the `%%ddp_train` cell "
            "runs as a DDP job (all GPUs, or 2 CPU processes where there is none) while its live view shows "
            "progress, every rank's log and the metrics; then `model` holds the trained weights, on the CPU."
        ),
        new_code_cell("%load_ext nbddp"),
        new_code_cell("epochs = 12\nlr = 0.05\nbatch_size = 32\nseed = 0", metadata={"tags": ["parameters"]}),
        new_code_cell("#| ddp\nimport nbddp\n" + DATA + "\ntrain_loader = DataLoader(TensorDataset(X_train, y_train), "
                      "batch_size=batch_size, shuffle=True)"),
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


KERNELSPEC = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}


def accelerate_notebook() -> NotebookNode:
    """Written as Accelerate's notebook_launcher tutorial shows; nbddp runs it unchanged."""
    return new_notebook(cells=[
        new_markdown_cell(
            "# Digits with Accelerate's `notebook_launcher`, unchanged\n\n"
            "Written as Accelerate's docs show: a training function and `notebook_launcher(..., num_processes=2)`. "
            "`nbddp run notebooks/digits_accelerate.ipynb` runs the function in 2 ranks started by torchrun "
            "(no fork of the kernel, so a kernel that touched CUDA is no problem), streams them, and loads the "
            "trained `model` back here, where the last cell evaluates it on the CPU. The only addition: the "
            "`#| ddp` directives say which cells the ranks need."
        ),
        new_code_cell("epochs = 12\nlr = 0.05\nbatch_size = 32\nseed = 0", metadata={"tags": ["parameters"]}),
        new_code_cell("#| ddp\nfrom accelerate import Accelerator, notebook_launcher\n" + DATA),
        new_code_cell(
            "#| ddp\n"
            "def training_loop(model, epochs, lr, batch_size, mixed_precision=\"no\"):\n"
            "    accelerator = Accelerator(mixed_precision=mixed_precision)\n"
            "    loader = DataLoader(TensorDataset(X_train, y_train), batch_size=batch_size, shuffle=True)\n"
            "    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)\n"
            "    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)\n"
            "    for epoch in range(epochs):\n"
            "        for xb, yb in loader:\n"
            "            optimizer.zero_grad()\n"
            "            loss = nn.functional.cross_entropy(model(xb), yb)\n"
            "            accelerator.backward(loss)\n"
            "            optimizer.step()\n"
            "        accelerator.print(f\"epoch {epoch + 1} loss {loss.item():.4f} \"\n"
            "                          f\"({accelerator.num_processes} processes, {accelerator.distributed_type})\")"
        ),
        new_code_cell("#| ddp-train\n"
                      "notebook_launcher(training_loop, args=(model, epochs, lr, batch_size), num_processes=2)"),
        new_code_cell(EVALUATE),
    ], metadata=KERNELSPEC)


def lightning_notebook() -> NotebookNode:
    """A LightningModule and Trainer(strategy="ddp_notebook", devices=2), as Lightning's docs show."""
    return new_notebook(cells=[
        new_markdown_cell(
            "# Digits with PyTorch Lightning's `ddp_notebook`, unchanged\n\n"
            "A `LightningModule` and `Trainer(strategy=\"ddp_notebook\", devices=2)`, as Lightning's docs show. "
            "`nbddp run notebooks/digits_lightning.ipynb` runs `trainer.fit` in 2 ranks started by torchrun "
            "(as `strategy=\"ddp\"`: Lightning then joins those ranks instead of forking the kernel), the logged "
            "metrics drive nbddp's progress and plot, and the trained module comes back here."
        ),
        new_code_cell("epochs = 12\nlr = 0.05\nbatch_size = 32\nseed = 0", metadata={"tags": ["parameters"]}),
        new_code_cell("#| ddp\nimport lightning as L\n" + DATA.replace(
            "model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))", "") +
            "train_loader = DataLoader(TensorDataset(X_train, y_train), batch_size=batch_size, shuffle=True)\n\n\n"
            "class Classifier(L.LightningModule):\n"
            "    def __init__(self, lr):\n"
            "        super().__init__()\n"
            "        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))\n"
            "        self.lr = lr\n\n"
            "    def forward(self, x):\n"
            "        return self.net(x)\n\n"
            "    def training_step(self, batch, batch_idx):\n"
            "        xb, yb = batch\n"
            "        loss = nn.functional.cross_entropy(self(xb), yb)\n"
            "        self.log(\"train_loss\", loss, on_epoch=True, on_step=False, sync_dist=True)\n"
            "        return loss\n\n"
            "    def configure_optimizers(self):\n"
            "        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)\n\n\n"
            "model = Classifier(lr)"),
        new_code_cell(
            "#| ddp-train\n"
            "trainer = L.Trainer(strategy=\"ddp_notebook\", devices=2, accelerator=\"cpu\", max_epochs=epochs,\n"
            "                    enable_progress_bar=False, enable_model_summary=False, logger=False,\n"
            "                    enable_checkpointing=False)\n"
            "trainer.fit(model, train_loader)"
        ),
        new_code_cell(EVALUATE),
    ], metadata=KERNELSPEC)


def transformers_notebook() -> NotebookNode:
    """A tiny GPT-2 built from its config, trained with the Hugging Face Trainer."""
    return new_notebook(cells=[
        new_markdown_cell(
            "# A tiny GPT-2 with the Hugging Face `Trainer`, unchanged\n\n"
            "A GPT-2 built from a small `GPT2Config` (nothing downloaded) learns to continue arithmetic "
            "sequences (`s, s+k, s+2k, ...` modulo 32). `nbddp run notebooks/tiny_gpt2_transformers.ipynb` "
            "runs `trainer.train()` in 2 ranks started by torchrun (`TrainingArguments` picks them up), the "
            "Trainer's logs drive nbddp's progress and plot, and the trained `model` comes back here."
        ),
        new_code_cell("epochs = 30\nlr = 3e-3\nbatch_size = 16\nseed = 0", metadata={"tags": ["parameters"]}),
        new_code_cell(
            "#| ddp\n"
            "import torch\n"
            "from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments\n\n"
            "torch.manual_seed(seed)\n"
            "VOCAB, LENGTH = 32, 12\n"
            "starts, steps = torch.meshgrid(torch.arange(VOCAB), torch.arange(1, 5), indexing=\"ij\")\n"
            "sequences = (starts.reshape(-1, 1) + steps.reshape(-1, 1) * torch.arange(LENGTH)) % VOCAB"
            "  # 128 sequences\n"
            "shuffled = sequences[torch.randperm(len(sequences))]\n"
            "train_sequences, test_sequences = shuffled[:96], shuffled[96:]\n\n\n"
            "class Sequences(torch.utils.data.Dataset):\n"
            "    def __init__(self, rows):\n"
            "        self.rows = rows\n\n"
            "    def __len__(self):\n"
            "        return len(self.rows)\n\n"
            "    def __getitem__(self, i):\n"
            "        return {\"input_ids\": self.rows[i], \"labels\": self.rows[i]}\n\n\n"
            "config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=2, n_head=4)\n"
            "model = GPT2LMHeadModel(config)"
        ),
        new_code_cell(
            "#| ddp-train\n"
            "args = TrainingArguments(output_dir=\"gpt2-out\", per_device_train_batch_size=batch_size,\n"
            "                         num_train_epochs=epochs, learning_rate=lr, logging_steps=10,\n"
            "                         save_strategy=\"no\", report_to=\"none\", disable_tqdm=True, seed=seed)\n"
            "trainer = Trainer(model=model, args=args, train_dataset=Sequences(train_sequences))\n"
            "trainer.train()"
        ),
        new_code_cell(
            "# Runs in the kernel, on the CPU, with the weights the ranks trained.\n"
            "model.eval()\n"
            "with torch.no_grad():\n"
            "    predicted = model(input_ids=test_sequences).logits[:, 1:-1].argmax(-1)\n"
            "accuracy = (predicted == test_sequences[:, 2:]).float().mean().item()\n"
            "print(f\"next-token accuracy on unseen sequences (after 2 tokens): {accuracy:.3f}\")"
        ),
    ], metadata=KERNELSPEC)


def tutorial_notebook() -> NotebookNode:
    """Written as PyTorch's DDP tutorial teaches: setup/cleanup, a function per process, mp.spawn; nbddp runs it
    unchanged (only the two marks added)."""
    return new_notebook(cells=[
        new_markdown_cell(
            "# Digits, as PyTorch's DDP tutorial writes it: `mp.spawn`\n\n"
            "`setup`/`cleanup`, a `train(rank, world_size)` function run in every process and "
            "`mp.spawn(train, args=(world_size,), nprocs=world_size)`, as in PyTorch's "
            "*Getting Started with Distributed Data Parallel*. In a notebook `mp.spawn` fails (its children can't "
            "find `train` in the kernel); under nbddp each rank runs `train(local_rank, world_size)` once, its "
            "`init_process_group` joins nbddp's group, and the trained `model` comes back here.\n\n"
            "Run it: `nbddp run notebooks/ddp_tutorial.ipynb` (all GPUs, or 2 CPU processes)."
        ),
        new_code_cell("epochs = 12\nlr = 0.05\nbatch_size = 32\nseed = 0", metadata={"tags": ["parameters"]}),
        new_code_cell(
            "#| ddp\n"
            "import os\n"
            "import torch\n"
            "import torch.distributed as dist\n"
            "import torch.multiprocessing as mp\n"
            "import torch.nn as nn\n"
            "import torch.optim as optim\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "from torch.utils.data import DataLoader, TensorDataset\n"
            "from torch.utils.data.distributed import DistributedSampler\n"
            "from sklearn.datasets import load_digits\n"
            "from sklearn.model_selection import train_test_split\n\n\n"
            "def setup(rank, world_size):\n"
            "    os.environ['MASTER_ADDR'] = 'localhost'\n"
            "    os.environ['MASTER_PORT'] = '12355'\n"
            "    # initialize the process group: NCCL on GPUs, gloo on CPUs\n"
            "    dist.init_process_group(\"nccl\" if torch.cuda.is_available() else \"gloo\", rank=rank, "
            "world_size=world_size)\n\n\n"
            "def cleanup():\n"
            "    dist.destroy_process_group()\n\n\n"
            "torch.manual_seed(seed)\n"
            "digits = load_digits()  # 1,797 8x8 images that ship with scikit-learn: no download\n"
            "X = torch.tensor(digits.data / 16.0, dtype=torch.float32)\n"
            "y = torch.tensor(digits.target)\n"
            "X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.25, random_state=0, stratify=y)\n"
            "dataset = TensorDataset(X_train, y_train)\n"
            "model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))\n\n\n"
            "def train(rank, world_size):\n"
            "    setup(rank, world_size)\n"
            "    device = torch.device(\"cuda\", rank) if torch.cuda.is_available() else torch.device(\"cpu\")\n"
            "    ddp_model = DDP(model.to(device), device_ids=[rank] if device.type == \"cuda\" else None)\n"
            "    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)\n"
            "    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)\n"
            "    optimizer = optim.SGD(ddp_model.parameters(), lr=lr, momentum=0.9)\n"
            "    for epoch in range(epochs):\n"
            "        sampler.set_epoch(epoch)\n"
            "        for xb, yb in loader:\n"
            "            optimizer.zero_grad()\n"
            "            loss = nn.functional.cross_entropy(ddp_model(xb.to(device)), yb.to(device))\n"
            "            loss.backward()\n"
            "            optimizer.step()\n"
            "        if rank == 0:\n"
            "            print(f\"epoch {epoch + 1} loss {loss.item():.4f}\")\n"
            "    cleanup()"
        ),
        new_code_cell(
            "#| ddp-train\n"
            "world_size = torch.cuda.device_count() or 2  # every GPU, or 2 CPU processes\n"
            "mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)"
        ),
        new_code_cell(EVALUATE),
    ], metadata=KERNELSPEC)


def tune_notebook() -> NotebookNode:
    """An Optuna study over the %%ddp_train cell, every trial on the kernel's warm ranks (nbddp.objective)."""
    return new_notebook(cells=[
        new_markdown_cell(
            "# Searching hyperparameters with Optuna, on warm ranks\n\n"
            "`study.optimize(nbddp.objective(space, metric=\"val_loss\"), n_trials=N)` runs the `%%ddp_train` cell "
            "once per trial, on the kernel's warm ranks, with the trial's values in place of the kernel's `lr` and "
            "`hidden`. Each `nbddp.log(val_loss=...)` reaches the trial as it is logged; a trial the pruner stops "
            "ends within a second, and the next one starts on the same ranks."
        ),
        new_code_cell("%load_ext nbddp"),
        new_code_cell("epochs = 10\nlr = 0.05\nhidden = 64\nbatch_size = 32\nseed = 0\nn_trials = 12",
                      metadata={"tags": ["parameters"]}),
        new_code_cell(
            "#| ddp\nimport nbddp\nimport torch\nfrom torch import nn\n"
            "from torch.utils.data import DataLoader, TensorDataset\n"
            "from sklearn.datasets import load_digits\nfrom sklearn.model_selection import train_test_split\n\n"
            "digits = load_digits()  # 1,797 8x8 images that ship with scikit-learn: no download\n"
            "X = torch.tensor(digits.data / 16.0, dtype=torch.float32)\ny = torch.tensor(digits.target)\n"
            "X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.25, random_state=0, stratify=y)\n"
            "train_loader = DataLoader(TensorDataset(X_train, y_train), batch_size=batch_size, shuffle=True)\n\n\n"
            "def make_model(hidden):\n"
            "    torch.manual_seed(seed)\n"
            "    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))\n\n\n"
            "model = make_model(hidden)"
        ),
        new_code_cell(
            "%%ddp_train\n"
            "ddp_model = nbddp.prepare(model)\n"
            "loader = nbddp.prepare(train_loader)\n"
            "optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=0.9)\n"
            "for epoch in range(epochs):\n"
            "    for xb, yb in loader:\n"
            "        optimizer.zero_grad()\n"
            "        nn.functional.cross_entropy(ddp_model(xb), yb).backward()\n"
            "        optimizer.step()\n"
            "    with torch.no_grad():\n"
            "        val_loss = nn.functional.cross_entropy(model(X_test), y_test).item()\n"
            "    nbddp.log(epoch=epoch + 1, val_loss=val_loss)"
        ),
        new_markdown_cell(
            "The study: Optuna's own loop, sampler and pruner. The space names the values to search; each must be "
            "a name the training cell takes from the kernel (here `lr` and `hidden`)."
        ),
        new_code_cell(
            "import optuna\n\n\n"
            "def space(trial):\n"
            "    return {\"lr\": trial.suggest_float(\"lr\", 1e-3, 0.3, log=True),\n"
            "            \"hidden\": trial.suggest_int(\"hidden\", 16, 256, log=True)}\n\n\n"
            "optuna.logging.set_verbosity(optuna.logging.WARNING)\n"
            "study = optuna.create_study(direction=\"minimize\", sampler=optuna.samplers.TPESampler(seed=seed),\n"
            "                            pruner=optuna.pruners.MedianPruner(n_startup_trials=3))\n"
            "study.optimize(nbddp.objective(space, metric=\"val_loss\"), n_trials=n_trials)\n"
            "study.best_params"
        ),
        new_code_cell(
            "# The best trial's weights, from its run dir, evaluated here on the CPU.\n"
            "model = make_model(study.best_params[\"hidden\"])\n"
            "model.load_state_dict(nbddp.load_weights(study.best_trial.user_attrs[\"run_dir\"])[\"model\"])\n"
            "model.eval()\n"
            "with torch.no_grad():\n"
            "    accuracy = (model(X_test).argmax(dim=1) == y_test).float().mean().item()\n"
            "print(f\"best trial {study.best_trial.number}: test accuracy {accuracy:.3f}\")"
        ),
    ], metadata=KERNELSPEC)


if __name__ == "__main__":
    import sys

    for name, nb in [("digits_torch.ipynb", torch_notebook()), ("digits_catalyst.ipynb", catalyst_notebook()),
                     ("digits_magic.ipynb", magic_notebook()), ("digits_accelerate.ipynb", accelerate_notebook()),
                     ("digits_lightning.ipynb", lightning_notebook()),
                     ("tiny_gpt2_transformers.ipynb", transformers_notebook()),
                     ("ddp_tutorial.ipynb", tutorial_notebook()), ("digits_tune.ipynb", tune_notebook())]:
        if sys.argv[1:] and name not in sys.argv[1:]:  # (only the named ones)
            continue
        nbformat.validate(nb)
        nbformat.write(nb, HERE / name)
        print("wrote", HERE / name)
