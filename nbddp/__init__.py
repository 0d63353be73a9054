"""nbddp: distributed PyTorch training (DDP) for people who live in Jupyter.

``import nbddp`` stays light (no torch): the front doors (``nbddp.run``, ``nbddp.batch``, the
``%%ddp_train`` magic) and the helpers used inside training cells (``prepare``, ``log``, ``rank``, …)
are loaded on first use.
"""

from __future__ import annotations

import typing as _typing

from nbddp._version import __version__

#: The API of training cells (:mod:`nbddp.rank_side.torch_engine`).
_RUNTIME = ("prepare", "log", "rank", "world_size", "local_rank", "is_main", "device",
            "save_checkpoint", "restore", "restart_count", "breakpoint")
#: Running notebooks from Python: the functions (:mod:`nbddp.api`), what they take (:mod:`nbddp.plan.options`) and
#: what they return.
_API = ("run", "batch", "BatchResult", "tune", "load_weights")
#: A hyperparameter search in a kernel: Optuna's objective over the kernel's training cell
#: (:mod:`nbddp.doors.jupyter.tune`).
_TUNE = ("objective",)
_OPTIONS = ("LaunchOptions", "Nodes", "SlurmRequest", "RayRequest")
__all__ = ["__version__", "load_ipython_extension", *_API, *_TUNE, "RunResult", *_OPTIONS, *_RUNTIME]


def __getattr__(name: str) -> _typing.Any:
    if name in _RUNTIME:
        from nbddp.rank_side import torch_engine

        return getattr(torch_engine, name)
    if name in _API:
        from nbddp import api

        return getattr(api, name)
    if name in _TUNE:
        from nbddp.doors.jupyter import tune

        return getattr(tune, name)
    if name in _OPTIONS:
        from nbddp.plan import options

        return getattr(options, name)
    if name == "RunResult":
        from nbddp.job.orchestrator import RunResult

        return RunResult
    raise AttributeError(f"module 'nbddp' has no attribute {name!r}")


def __dir__() -> list[str]:
    """What ``nbddp.`` offers (``dir(nbddp)``, a notebook's completion): the public names and the module's own
    dunders, not what this file imports."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


def load_ipython_extension(ipython: _typing.Any) -> None:
    """``%load_ext nbddp``: starts the warm ranks' starter (it imports torch in the background: loading the extension
    is the intent to train), then registers the ``%%ddp_train`` cell magic and the others."""
    from nbddp.doors.jupyter.kernel_pool import kernel_pool

    said = kernel_pool.prepare()  # first: the magics' imports take 0.2 s
    from nbddp.doors.jupyter.magics import load_ipython_extension as load
    from nbddp.rank_side.catalyst_compat import apply_catalyst_shims

    apply_catalyst_shims()  # Catalyst cells run in this kernel too (single process), as the ranks run them

    load(ipython)
    if said:
        print(f"[nbddp] {said}")
