"""The torch engine: plain DDP under ``torch.distributed.run`` (torchrun).

The script joins the process group through the nbddp runtime at import time,
so ``ddp`` cells may already call ``nbddp.prepare(model)``; run without a
launcher it is an ordinary single process, so the same script also debugs with
plain ``python train.py``.
"""

from __future__ import annotations

from nbddp.engines import EngineCode


def code(returns: tuple[str, ...], script_name: str) -> EngineCode:
    return EngineCode(
        imports=(
            "import nbddp.runtime as _nbddp",
            "_nbddp.start()  # joins the process group (nccl on GPUs, gloo on CPU) under torchrun",
        ),
        train_prologue=(),
        train_epilogue=(f"_nbddp.finish(globals(), returns={list(returns)!r})  # rank 0 saves the returned state",),
        launch_hint=f"python -m torch.distributed.run --standalone --nproc-per-node 2 {script_name}",
    )


def launch_command(
    script: str, nproc: int, *, python: str, max_restarts: int = 0, log_dir: str | None = None
) -> list[str]:
    """torchrun's argv for one machine: a fresh c10d store on an OS-chosen free port.

    ``--standalone`` picks a free port, so two runs at once never collide, and
    torchrun runs in its own process (never ``elastic_launch`` inside the
    kernel: it replaces the kernel's SIGINT handler). ``log_dir``: torchrun's own
    folder (per-attempt error files); without it torchrun leaves a ``torchelastic_*``
    folder in the system temp folder after every run.
    """
    return [
        python, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1", *([f"--log-dir={log_dir}"] if log_dir else []), script,
    ]
