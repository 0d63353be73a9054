"""Tests that need an optional package (an extra): skipped where it is missing, except where it must be there.

``.ci/run`` installs every extra and sets ``NBDDP_REQUIRE_EXTRAS=1``: there a missing package is a broken
install, and a skip would hide it (a test suite that is green because it ran nothing), so :func:`need` fails.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

#: Set by .ci/run: every extra is installed, so a missing one fails the test that needs it.
REQUIRE = "NBDDP_REQUIRE_EXTRAS"


def need(module: str, reason: str | None = None) -> ModuleType:
    """``module``, imported; missing: the test skips (:func:`pytest.importorskip`), or fails under ``NBDDP_REQUIRE_EXTRAS=1``."""
    if os.environ.get(REQUIRE) != "1":
        return pytest.importorskip(module, reason=reason)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{REQUIRE}=1 (every extra installed), but {module} can't be imported: {exc}", pytrace=False)
