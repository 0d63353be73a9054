"""The torch engine: plain DDP under ``torch.distributed.run`` (torchrun).

The script joins the process group through the nbddp runtime at import time,
so ``ddp`` cells may already call ``nbddp.prepare(model)``; run without a
launcher it is an ordinary single process, so the same script also debugs with
plain ``python train.py``.
"""

from __future__ import annotations

from nbddp.devices import CPU_PROCESSES
from nbddp.engines import EngineCode
from nbddp.launchers.torchrun import by_hand, torchrun_options


def code(returns: tuple[str, ...], script_name: str) -> EngineCode:
    return EngineCode(
        imports=(
            "import nbddp.rank_side.torch_engine as _nbddp",
            "_nbddp.start()  # joins the process group (nccl on GPUs, gloo on CPU) under torchrun",
        ),
        train_prologue=(),
        train_epilogue=(f"_nbddp.finish(globals(), returns={list(returns)!r})  # rank 0 saves the returned state",),
        launch_hint=by_hand(torchrun_options(CPU_PROCESSES), script_name),
    )
