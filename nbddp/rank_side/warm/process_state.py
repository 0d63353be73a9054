"""What a process holds besides its objects, captured and put back: one capture for the warm loop (around each
job) and the warm state (after each kept setup cell).

A job, or a setup cell, may change the working folder, ``sys.path``, torch's process-wide settings, the
environment and the random generators; a fresh rank starts from none of those changes, so a warm rank puts them
back: the loop as they were before the job (:meth:`ProcessState.restore`, the whole environment), the warm state
as they were after the last kept cell (its generators, settings, folder and path; each kept cell's changes to
the environment applied on top of the job's own, :meth:`ProcessState.apply_environ`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class ProcessState:
    cwd: str
    path: list[str]
    settings: dict[str, Any]
    """torch's process-wide settings (:func:`torch_settings`)."""
    environ: dict[str, str]
    """The environment variables set or changed since the base it was captured against (all of them: none)."""
    removed: list[str] = field(default_factory=list)
    """Those the base had and the process no longer has."""
    whole: bool = False
    """``environ`` is the whole environment (captured against no base): restoring it replaces the environment."""
    generators: dict[str, Any] | None = None
    """The random generators' states (torch's, CUDA's if initialised, ``random``'s, NumPy's if imported)."""

    @classmethod
    def capture(cls, since: Mapping[str, str] | None = None, generators: bool = False) -> "ProcessState":
        """The process now; its environment as the changes ``since`` that environment (``None``: all of it)."""
        environ = dict(os.environ) if since is None else {k: v for k, v in os.environ.items() if since.get(k) != v}
        removed = [] if since is None else [k for k in since if k not in os.environ]
        return cls(os.getcwd(), list(sys.path), torch_settings(), environ, removed, since is None,
                   _generators() if generators else None)

    def restore(self, environ: bool = True) -> None:
        """Put the process back as captured (``environ=False``: all but the environment)."""
        if environ:
            if self.whole:
                os.environ.clear()
            self.apply_environ()
        try:
            os.chdir(self.cwd)
        except OSError:  # (a folder a cell made and a later job removed: stay where the job left it)
            pass
        sys.path[:] = self.path
        set_torch_settings(self.settings)
        if self.generators is not None:
            _set_generators(self.generators)

    def apply_environ(self) -> None:
        """The captured changes to the environment, applied to the one the process has now."""
        os.environ.update(self.environ)
        for name in self.removed:
            os.environ.pop(name, None)


def _generators() -> dict[str, Any]:
    import random

    import torch

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _set_generators(state: dict[str, Any]) -> None:
    import random

    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])


def torch_settings() -> dict[str, Any]:
    """torch's process-wide settings a job may change (a fresh rank starts from the defaults)."""
    import torch

    return {"dtype": torch.get_default_dtype(), "threads": torch.get_num_threads(),
            "grad": torch.is_grad_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_tf32": torch.backends.cudnn.allow_tf32, "matmul_precision": torch.get_float32_matmul_precision()}


def set_torch_settings(settings: dict[str, Any]) -> None:
    import torch

    torch.set_default_dtype(settings["dtype"])
    torch.set_num_threads(settings["threads"])
    torch.set_grad_enabled(settings["grad"])
    torch.use_deterministic_algorithms(settings["deterministic"])
    torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = settings["cudnn_deterministic"]
    torch.backends.cudnn.allow_tf32 = settings["cudnn_tf32"]
    torch.set_float32_matmul_precision(settings["matmul_precision"])
