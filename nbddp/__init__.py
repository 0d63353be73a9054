"""nbddp: distributed PyTorch training (DDP) for people who live in Jupyter.

``import nbddp`` stays light (no torch): the runtime helpers used inside
training cells (``prepare``, ``log``, ``rank``, …) are loaded on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_RUNTIME = ("prepare", "log", "rank", "world_size", "local_rank", "is_main", "device",
            "save_checkpoint", "restore", "restart_count")
__all__ = ["__version__", "batch", "load_ipython_extension", *_RUNTIME]


def __getattr__(name: str) -> Any:
    if name in _RUNTIME:
        from nbddp.rank_side import torch_engine as runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'nbddp' has no attribute {name!r}")


def batch(notebook: Any, grid: Any, **options: Any) -> Any:
    """Run ``notebook`` once per parameter set of ``grid``; see :func:`nbddp.doors.batch.schedule.batch`.

    (The module is ``nbddp.doors.batch.schedule``: a submodule named ``batch`` would replace this function
    on the package as soon as it was imported.)
    """
    from nbddp.doors.batch.schedule import batch as run

    return run(notebook, grid, **options)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbddp``: registers the ``%%ddp_train`` cell magic."""
    from nbddp.doors.jupyter.magics import load_ipython_extension as load

    load(ipython)
