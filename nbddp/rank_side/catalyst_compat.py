"""Compatibility shims for Catalyst 22.4 (its last release) on current accelerate.

accelerate renamed ``DistributedType.TPU`` to ``XLA``; Catalyst's engine and
metric callbacks still read ``TPU`` and crash outside DDP (a Catalyst cell run
in the kernel) with ``AttributeError: TPU``. The alias is restored — at once
if accelerate is already imported, else the moment it is, so that
``%load_ext nbddp`` does not import torch for users who never touch Catalyst.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Sequence

_TARGET = "accelerate.utils"


def apply_catalyst_shims() -> None:
    """Alias ``DistributedType.TPU`` → ``XLA`` now, or as soon as ``accelerate.utils`` is imported."""
    module = sys.modules.get(_TARGET)
    if module is not None:
        _alias_tpu(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _alias_tpu(module: ModuleType) -> None:
    kind = getattr(module, "DistributedType", None)
    if kind is not None and not hasattr(kind, "TPU") and hasattr(kind, "XLA"):
        type.__setattr__(kind, "TPU", kind.XLA)


class _AfterImport(importlib.abc.MetaPathFinder):
    """One-shot finder: lets the normal import of ``accelerate.utils`` happen, then shims it."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _alias_tpu(module)

        spec.loader.exec_module = exec_module
        return spec
