"""Notebooks written the way Accelerate, Lightning and the Hugging Face Trainer document them.

Each trains a tiny model on data built in code, so that one process with the whole global batch
computes the same training: :func:`one_process` runs that reference in a plain Python process, with the
library itself and no nbddp. ``FAIL`` / ``SLOW`` mark where a test makes a rank fail or the training last.
"""

from __future__ import annotations

import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.conftest import PYTHON, code

DATA = """\
torch.manual_seed(0)
X = torch.linspace(-1, 1, 64 * 4).reshape(64, 4)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])"""


@dataclass(frozen=True)
class FrameworkNotebook:
    engine: str
    setup: str
    """The ``#| ddp`` cell (without its directive)."""
    train: str
    """The training cell, formatted with ``batch`` (per process), ``fail`` and ``slow``."""
    evaluate: str
    """An untagged cell after the training: the kernel evaluates the returned model on the CPU and prints
    ``kernel weights S``, the sum of its weights (:func:`weights_sum`), so a test sees the kernel's model
    was trained (Lightning's ``ddp_notebook`` leaves it untouched: Lightning#2092)."""
    batch: int

    def cells(self, fail: str = "False", slow: str = "0") -> list:
        train = self.train.format(batch=self.batch, fail=fail, slow=slow)
        return [code("#| ddp\n" + self.setup), code("#| ddp-train\n" + train), code(self.evaluate)]

    def unmarked_cells(self, fail: str = "False", slow: str = "0") -> list:
        """The same notebook with no cell marked, as the library's docs write it: 1 the imports, 2 the data
        and model, 3 a look at the model (the training doesn't need it), 4 the training, 5 the evaluation."""
        lines = self.setup.split("\n")
        imports, rest = "\n".join(lines[:4]), "\n".join(lines[4:])  # IMPORTS and the library's own import
        train = self.train.format(batch=self.batch, fail=fail, slow=slow)
        return [code(imports), code(rest), code(LOOK), code(train), code(self.evaluate)]

    def reference(self, tmp_path: Path, world_size: int = 2) -> dict[str, torch.Tensor]:
        """The model's weights after the same training in one process with the global batch."""
        train = self.train.format(batch=self.batch * world_size, fail="False", slow="0")
        train = train.replace("num_processes=2", "num_processes=1").replace("devices=2", "devices=1")
        return one_process(self.setup + "\n" + train, tmp_path)


def weights_sum(state: dict[str, torch.Tensor]) -> float:
    """What the evaluation cell prints as ``kernel weights``."""
    return round(sum(float(v.double().sum()) for v in state.values()), 4)


def one_process(source: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Run ``source`` (which defines ``model``) in a fresh Python process; ``model``'s state dict after it."""
    out = tmp_path / "reference.pt"
    script = tmp_path / "reference.py"
    script.write_text(source + f"\ntorch.save({{k: v.detach().cpu() for k, v in model.state_dict().items()}}, {str(out)!r})\n")
    # On the CPU, as the ranks it is compared with (--cpu): this one process sees no GPU (Accelerate and a
    # single-process Trainer would take one, whatever ACCELERATE_USE_CPU says).
    done = subprocess.run([PYTHON, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path),
                               "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(out, weights_only=True)


IMPORTS = "import time\nimport torch\nfrom torch import nn\n"
#: A cell of an unmarked notebook that only looks: it runs in the kernel, never in the ranks.
LOOK = "print('a look at the model:', sum(p.numel() for p in model.parameters()), 'parameters')"

ACCELERATE = FrameworkNotebook(
    engine="accelerate",
    setup=IMPORTS + "from accelerate import Accelerator, notebook_launcher\n" + DATA + textwrap.dedent('''
        model = nn.Linear(4, 1)

        def training_loop(model, epochs, batch_size, fail=False, slow=0):
            accelerator = Accelerator()
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=batch_size)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            for epoch in range(epochs):
                for x, y in loader:
                    optimizer.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    if fail and accelerator.process_index == 1:
                        raise ValueError("rank 1 fails on purpose")
                    time.sleep(slow)
                accelerator.print(f"epoch {epoch} loss {loss.item():.4f} on {accelerator.num_processes} "
                                  f"processes, {accelerator.distributed_type}")'''),
    train="notebook_launcher(training_loop, args=(model, 3, {batch}, {fail}, {slow}), num_processes=2)",
    evaluate="print('kernel loss', round(nn.functional.mse_loss(model(X), Y).item(), 5))"
             "\nprint('kernel weights', round(sum(float(v.double().sum()) for v in model.state_dict().values()), 4))",
    batch=8,
)

LIGHTNING = FrameworkNotebook(
    engine="lightning",
    setup=IMPORTS + "import lightning as L\n" + DATA + textwrap.dedent('''
        class Regression(L.LightningModule):
            def __init__(self, fail=False, slow=0):
                super().__init__()
                self.net = nn.Linear(4, 1)
                self.fail, self.slow = fail, slow

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = nn.functional.mse_loss(self.net(x), y)
                self.log("train_loss", loss)
                if self.fail and self.global_rank == 1:
                    raise ValueError("rank 1 fails on purpose")
                time.sleep(self.slow)
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05)

        torch.manual_seed(0)
        model = Regression()'''),
    train=("model.fail, model.slow = {fail}, {slow}\n"
           "loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size={batch})\n"
           "trainer = L.Trainer(strategy=\"ddp_notebook\", devices=2, accelerator=\"cpu\", max_epochs=3,\n"
           "                    logger=False, enable_checkpointing=False, enable_progress_bar=False)\n"
           "trainer.fit(model, loader)"),
    evaluate="print('kernel loss', round(nn.functional.mse_loss(model.net(X), Y).item(), 5))"
             "\nprint('kernel weights', round(sum(float(v.double().sum()) for v in model.state_dict().values()), 4))",
    batch=8,
)

TRANSFORMERS = FrameworkNotebook(
    engine="transformers",
    setup=IMPORTS + "from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, TrainerCallback\n"
    + textwrap.dedent('''
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config)
        tokens = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(1))

        class Sequences(torch.utils.data.Dataset):
            def __len__(self):
                return len(tokens)

            def __getitem__(self, i):
                return {"input_ids": tokens[i], "labels": tokens[i]}

        class Hooks(TrainerCallback):
            def __init__(self, fail=False, slow=0):
                self.fail, self.slow = fail, slow

            def on_step_end(self, args, state, control, **kwargs):
                if self.fail and args.process_index == 1:
                    raise ValueError("rank 1 fails on purpose")
                time.sleep(self.slow)'''),
    train=("args = TrainingArguments(output_dir=\"hf-out\", per_device_train_batch_size={batch}, num_train_epochs=4,\n"
           "                         optim=\"sgd\", learning_rate=0.05, logging_steps=1, save_strategy=\"no\",\n"
           "                         report_to=\"none\", disable_tqdm=True, seed=0)\n"
           "trainer = Trainer(model=model, args=args, train_dataset=Sequences(), callbacks=[Hooks({fail}, {slow})])\n"
           "trainer.train()"),
    evaluate=("with torch.no_grad():\n"
              "    print('kernel loss', round(model(input_ids=tokens, labels=tokens).loss.item(), 5))"
              "\nprint('kernel weights', round(sum(float(v.double().sum()) for v in model.state_dict().values()), 4))"),
    batch=8,
)

NOTEBOOKS = {nb.engine: nb for nb in (ACCELERATE, LIGHTNING, TRANSFORMERS)}
