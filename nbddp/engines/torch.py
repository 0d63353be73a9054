"""The torch engine: plain DDP under ``torch.distributed.run`` (torchrun).

The script joins the process group through the nbddp runtime at import time,
so ``ddp`` cells may already call ``nbddp.prepare(model)``; run without a
launcher it is an ordinary single process, so the same script also debugs with
plain ``python train.py``.
"""

from __future__ import annotations

from nbddp.engines import EngineCode
from nbddp.launchers.torchrun import default_hint


#: What ``--shard`` makes of ``nbddp.prepare(model)``, shown in the script's header as the code it runs.
SHARDED_PREPARE = (
    "Sharded (--shard): each nbddp.prepare(model) below runs, on every rank, instead of DDP:",
    "    from torch.distributed.fsdp import fully_shard",
    "    mesh = torch.distributed.device_mesh.init_device_mesh(device_type, (world_size,))",
    "    for block in blocks:   # the model's repeated submodules, or prepare(..., blocks=...)",
    "        fully_shard(block, mesh=mesh)",
    "    fully_shard(model, mesh=mesh)",
    "and at the end every rank gathers the full state dict for rank 0 to save",
    "(torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=",
    "StateDictOptions(full_state_dict=True, cpu_offload=True))).",
)


def code(returns: tuple[str, ...], script_name: str, shard: bool = False) -> EngineCode:
    start = ("_nbddp.start(shard=True)  # joins the process group under torchrun; prepare(model) shards (FSDP2)"
             if shard else "_nbddp.start()  # joins the process group (nccl on GPUs, gloo on CPU) under torchrun")
    return EngineCode(
        imports=("import nbddp.rank_side.torch_engine as _nbddp", start),
        train_prologue=(),
        train_epilogue=(f"_nbddp.finish(globals(), returns={list(returns)!r})  # rank 0 saves the returned state",),
        launch_hint=default_hint(script_name),
        notes=SHARDED_PREPARE if shard else (),
    )
