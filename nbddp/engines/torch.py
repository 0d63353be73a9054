"""The torch engine: plain DDP under ``torch.distributed.run`` (torchrun), and torchrun's command line.

The script joins the process group through the nbddp runtime at import time,
so ``ddp`` cells may already call ``nbddp.prepare(model)``; run without a
launcher it is an ordinary single process, so the same script also debugs with
plain ``python train.py``.

:func:`torchrun_options` is the one place torchrun's command line is written. The torchrun launcher's
argv (:mod:`nbddp.launchers.torchrun`), the line a Slurm job's tasks run (:mod:`nbddp.launchers.slurm`),
a warm pool's ranks and the command an exported script's header tells a person to type (here, and
:mod:`nbddp.launchers.by_hand`) are renderings of it, so they can't disagree about nodes, rendezvous or
timeouts (a test parses them with torchrun's own argument parser). It lives with the engine, below
the launchers, because the script's header needs it before any launcher is chosen.
"""

from __future__ import annotations

import ast
import math
import re
import shlex
from typing import Sequence

from nbddp.contracts.devices import CPU_PROCESSES
from nbddp.engines.engine import Engine, EngineCode, LaunchCall
from nbddp.engines.reading import spawns_ranks
from nbddp.contracts.rank_env import DEFAULT_RDZV_TIMEOUT

#: A run on one machine: the address torchrun's agent names its node by (it listens on nothing), and its
#: rendezvous file in the run's private store folder (:mod:`nbddp.launchers.private_rendezvous`).
LOOPBACK = "127.0.0.1"
RENDEZVOUS_FILE = "rendezvous"

#: What runs torchrun: ``python -m torch.distributed.run`` (not the ``torchrun`` script, which may
#: belong to another interpreter than the one that has nbddp).
MODULE = ("-m", "torch.distributed.run")

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
        imports=("import nbddp.runtime as _nbddp", start),
        train_prologue=(),
        train_epilogue=(f"_nbddp.finish(globals(), returns={list(returns)!r})  # rank 0 saves the returned state",),
        launch_hint=default_hint(script_name),
        notes=SHARDED_PREPARE if shard else (),
    )


def torchrun_options(nproc: int | str, *, nnodes: int | str = 1, node_rank: int | str | None = None,
                     endpoint: str | None = None, rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT,
                     max_restarts: int | None = None, monitor: bool = False, log_dir: str | None = None,
                     store: str | None = None) -> list[str]:
    """torchrun's options for one node: everything between ``python -m torch.distributed.run`` and the script.

    One machine (``nnodes == 1``), launched by nbddp: c10d's rendezvous in a FileStore in ``store``, the
    run's private folder, so nothing listens and nothing is unpickled from a socket
    (:mod:`nbddp.launchers.private_rendezvous`); typed by a person (the exported script's header):
    ``--standalone``, the same rendezvous in a TCPStore on an OS-chosen free port, torch's own trust
    model (a trusted network). Several nodes: torchrun's *static* rendezvous at ``endpoint`` (node 0),
    with ``node_rank`` (a number, or a placeholder such as ``"$SLURM_NODEID"`` or ``R``). Static, not c10d's
    dynamic rendezvous: node 0 runs the kernel and must hold global rank 0 (the weights are saved there);
    the dynamic one ranks nodes by sorting their descriptors, the static one honours ``--node-rank``.

    ``monitor``: check the ranks every 0.1 s (torchrun's default is 5 s: a failure would be seen late);
    ``log_dir``: keep torchrun's folder there (without it, every run leaves a ``torchelastic_*`` folder
    in the system temp folder); ``max_restarts``: ``None`` leaves torchrun's default.
    """
    if nnodes == 1 and store is not None:
        options = ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={store}/{RENDEZVOUS_FILE}",
                   "--rdzv-conf=store_type=file", f"--local-addr={LOOPBACK}"]
    elif nnodes == 1:
        options = ["--standalone"]
    else:
        options = [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=static",
                   f"--rdzv-endpoint={endpoint}", f"--rdzv-conf=timeout={math.ceil(rdzv_timeout)}"]
    options.append(f"--nproc-per-node={nproc}")
    if max_restarts is not None:
        options.append(f"--max-restarts={max_restarts}")
    if monitor:
        options.append("--monitor-interval=0.1")
    if log_dir is not None:
        options.append(f"--log-dir={log_dir}")
    return options


def torchrun_variables(rank: int, local_rank: int, nproc: int, nnodes: int = 1, node_rank: int = 0,
                       master: tuple[str, int] = (LOOPBACK, 0), run_id: str = "none") -> dict[str, str]:
    """What torchrun tells each of its ranks (``torch.distributed.run``'s worker environment): the variables
    the rank side, torch and the libraries read (Lightning takes ``RANK``, ``GROUP_RANK``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` for torchrun's ranks). For launchers that start torchrun's ranks without torchrun
    (:mod:`nbddp.launchers.direct`, the Ray driver)."""
    world = nproc * nnodes
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nnodes),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
            "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PYTHONUNBUFFERED": "1"}


def by_hand(options: Sequence[str], script: str, python: str = "python") -> str:
    """What a person types to run ``script`` under torchrun with ``options`` (placeholders left as they are)."""
    return " ".join([python, *MODULE, *(_shell_word(o) for o in options), shlex.quote(script)])


def default_hint(script: str) -> str:
    """The header's command when the export named no devices: ``CPU_PROCESSES`` processes, which on a
    GPU machine are one per GPU, so the header says how to start one per GPU there (a rank beyond the GPUs
    is refused: :func:`nbddp.contracts.devices.rank_gpu`)."""
    return (by_hand(torchrun_options(CPU_PROCESSES), script)
            + f"   (with G GPUs: {torchrun_options('G')[-1]}, one process per GPU)")


def _shell_word(option: str) -> str:
    """``--x=VALUE`` quoted for a shell unless it only holds characters a shell leaves alone."""
    return option if re.fullmatch(r"[\w./:=,@%+$-]+", option) else shlex.quote(option)


#: Plain PyTorch: what no other engine's notebook is (detection's answer when none calls for its own).
def _launches(call: LaunchCall) -> str | None:
    """PyTorch's DDP tutorial: ``mp.spawn(...)`` in the running code, or a call of a notebook function that makes it."""
    if "torch" in call.imported and spawns_ranks(call.call):
        return ast.unparse(call.call.func)
    if isinstance(call.call.func, ast.Name) and call.call.func.id in call.spawners:
        return f"{call.call.func.id} → mp.spawn"
    return None


ENGINE = Engine("torch", lambda request: code(request.returns, request.script_name, request.shard),
                launch_text="torch's mp.spawn(...)", launches=_launches)
