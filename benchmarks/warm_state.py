"""What keeping the setup on warm ranks is worth: ``python -m benchmarks.warm_state [--before GIT_REF]``.

In a real kernel driven by raw execute requests (with cell ids, as JupyterLab sends them), 2 gloo CPU
ranks (``--cpu``):

* **a 3 s setup cell**: a ``#| ddp`` cell sleeping 3 s (standing for loading and preparing a dataset),
  a cell building the model, a training cell (3 SGD steps); the training cell re-run unchanged, and
  after the model cell was edited;
* **``torch.compile``**: a model compiled in setup, 20 training steps; the first run and a re-run.

Each case also says whether a re-run's weights are, byte for byte, the first run's (a fresh run's: the
first run's ranks had nothing kept). With ``--before GIT_REF`` the same cases run on that earlier
nbddp too (extracted with ``git archive`` into a temporary folder), in the same rounds. The figures go
into BENCHMARKS.md's "warm-state" block (``--out``).
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from benchmarks.document import replace_block
from benchmarks.peers import Kernel

REPO = Path(__file__).resolve().parent.parent
DIGEST = ("import hashlib\nprint('WEIGHTS', hashlib.sha1(b''.join(p.detach().numpy().tobytes() "
          "for p in model.parameters())).hexdigest())")
SLOW = "#| ddp\nimport time, torch, nbddp\nfrom torch import nn\ntime.sleep(3)  # loading and preparing a dataset"
MODEL = "#| ddp\ntorch.manual_seed(0)\nmodel = nn.Linear(4, 1)\nX = torch.randn(64, 4)\ny = X.sum(1, keepdim=True)"
TRAIN = ("%%ddp_train --cpu\nddp = nbddp.prepare(model)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
         "for _ in range(3):\n    loss = nn.functional.mse_loss(ddp(X), y)\n    opt.zero_grad(); loss.backward(); opt.step()\n")
COMPILED = ("#| ddp\nimport torch, nbddp\nfrom torch import nn\ntorch.manual_seed(0)\n"
            "model = torch.compile(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))\n"
            "X = torch.randn(256, 64)\ny = X.sum(1, keepdim=True)")
COMPILED_TRAIN = ("%%ddp_train --cpu\nddp = nbddp.prepare(model)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.01)\n"
                  "for _ in range(20):\n    loss = nn.functional.mse_loss(ddp(X), y)\n"
                  "    opt.zero_grad(); loss.backward(); opt.step()\n")
COMPILED_DIGEST = DIGEST.replace("model.parameters()", "model._orig_mod.parameters()")


class CellKernel(Kernel):
    """A kernel whose cells carry ids (``%%ddp_train`` keeps the latest version of each ``#| ddp`` cell by id)."""

    def __init__(self, cwd: Path, pythonpath: str) -> None:
        # Each kernel with a cache of compiled kernels of its own: a first run compiles, whatever ran before it.
        changes = {"PYTHONPATH": pythonpath, "TORCHINDUCTOR_CACHE_DIR": str(cwd / "inductor")}
        saved = {name: os.environ.get(name) for name in changes}
        os.environ.update(changes)
        try:
            super().__init__(cwd)
        finally:
            for name, value in saved.items():
                os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)

    def cell(self, code: str, cell_id: str) -> tuple[float, str]:
        content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": True}
        msg = self.kc.session.msg("execute_request", content, metadata={"cellId": cell_id})
        self.kc.shell_channel.send(msg)
        done = self.finish(msg["header"]["msg_id"], time.monotonic())
        if done.raised:
            raise RuntimeError(f"the cell failed:\n{done.output[-2000:]}")
        return done.seconds, done.output

    def weights(self, digest: str = DIGEST) -> str:
        return self.cell(digest, "digest")[1].split("WEIGHTS", 1)[1].strip()


def setup_case(kernel: CellKernel) -> dict[str, list]:
    """The 3 s setup: first run, re-runs of the unchanged training cell, a run after the model cell was edited."""
    kernel.cell("%load_ext nbddp", "load")
    kernel.cell(SLOW, "slow")
    kernel.cell(MODEL, "model")
    first, _ = kernel.cell(TRAIN, "train")
    reference = kernel.weights()
    reruns, same = [], []
    for _ in range(3):
        seconds, _ = kernel.cell(TRAIN, "train")
        reruns.append(seconds)
        same.append(kernel.weights() == reference)
    kernel.cell(MODEL.replace("manual_seed(0)", "manual_seed(1)"), "model")
    edited, _ = kernel.cell(TRAIN, "train")
    return {"first": [first], "rerun": reruns, "edited": [edited], "same": same}


def compile_case(kernel: CellKernel) -> dict[str, list]:
    kernel.cell("%load_ext nbddp", "load")
    kernel.cell(COMPILED, "setup")
    first, _ = kernel.cell(COMPILED_TRAIN, "train")
    reference = kernel.weights(COMPILED_DIGEST)
    seconds, _ = kernel.cell(COMPILED_TRAIN, "train")
    return {"first": [first], "rerun": [seconds], "same": [kernel.weights(COMPILED_DIGEST) == reference]}


def measure(versions: dict[str, str], rounds: int,
            log: Callable[[str], None]) -> dict[str, dict[str, dict[str, list]]]:
    """``{version: {case: {figure: values}}}``, the versions interleaved round after round."""
    found: dict[str, dict[str, dict[str, list]]] = {v: {} for v in versions}
    for round_ in range(rounds):
        for version, pythonpath in versions.items():
            for case, run in (("setup", setup_case), ("compile", compile_case)):
                with tempfile.TemporaryDirectory(prefix="nbddp-warm-state-") as folder:
                    kernel = CellKernel(Path(folder), pythonpath)
                    try:
                        figures = run(kernel)
                    finally:
                        kernel.close()
                for name, values in figures.items():
                    found[version].setdefault(case, {}).setdefault(name, []).extend(values)
                log(f"round {round_ + 1}/{rounds} {version} {case}: {figures}")
    return found


def _median(values: list[float]) -> str:
    if not values:
        return "n/a"
    spread = f" ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.2f} s{spread}"


def _same(values: list[bool]) -> str:
    return "yes, byte for byte" if values and all(values) else f"**no** ({values.count(False)} of {len(values)})"


def markdown(found: dict[str, dict[str, dict[str, list]]], rounds: int, command: str) -> str:
    import torch

    lines = ["## 9. Warm state: a re-run pays only for what changed", "",
             f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {os.cpu_count()} cores, no GPU, Python "
             f"{platform.python_version()}, torch {torch.__version__}; {rounds} round(s), the versions interleaved; "
             f"`{command}`. `%%ddp_train --cpu` on 2 gloo ranks in a real kernel, execute request → idle; medians "
             "(min–max).", "",
             "| | " + " | ".join(found) + " |", "|---|" + "---|" * len(found)]
    rows = [("3 s setup cell: 1st run (starts the warm ranks)", "setup", "first", _median),
            ("3 s setup cell: re-run of the unchanged training cell", "setup", "rerun", _median),
            ("3 s setup cell: run after the model cell was edited", "setup", "edited", _median),
            ("re-run's weights equal the 1st (fresh) run's", "setup", "same", _same),
            ("`torch.compile`d in setup, 20 steps: 1st run", "compile", "first", _median),
            ("`torch.compile`d in setup, 20 steps: re-run", "compile", "rerun", _median),
            ("compiled re-run's weights equal the 1st run's", "compile", "same", _same)]
    for title, case, figure, show in rows:
        lines.append(f"| {title} | " + " | ".join(show(found[v].get(case, {}).get(figure, [])) for v in found) + " |")
    lines += ["", "A first run includes starting the warm ranks. Compiled code stayed in a warm rank's process before "
              "too (dynamo's caches are the process's), so a compiled re-run was already quick; what is new is that "
              "the setup around it, here 3 s, doesn't run again, and that the model it compiled is the one kept. "
              "Each kernel has inductor's on-disk cache to itself: every first run compiles. The machine is shared "
              "with other work: the spreads are wide."]
    return "\n".join(lines) + "\n"


def _checkout(ref: str, folder: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.warm_state", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", metavar="GIT_REF", default=None, help="also measure this earlier nbddp")
    parser.add_argument("--out", type=Path, default=None, help="write the section into this BENCHMARKS.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nbddp-before-") as folder:
        versions = {"nbddp (setup kept)": str(REPO)}
        if args.before:
            versions = {f"nbddp {args.before} (fresh namespace)": str(_checkout(args.before, Path(folder))), **versions}
        found = measure(versions, args.rounds, lambda text: print(text, flush=True))
    command = "python -m benchmarks.warm_state" + (f" --before {args.before}" if args.before else "") + \
        (f" --rounds {args.rounds}" if args.rounds != 3 else "")
    text = markdown(found, args.rounds, command)
    print(text)
    if args.out:
        replace_block(args.out, "warm-state", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
