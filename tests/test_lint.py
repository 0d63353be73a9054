"""The code's claims, checked: ruff with the rules its ``noqa`` comments name (configured in pyproject.toml; a
``noqa`` nothing needs fails too), and vulture for code nothing uses (what only a library or an entry point calls is
named in vulture_whitelist.py, with why)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} isn't installed (pip install -e '.[test]')")
    return found


def test_ruff_finds_nothing():
    done = subprocess.run([_tool("ruff"), "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]


def test_no_dead_code():
    done = subprocess.run([_tool("vulture"), "nbddp", "vulture_whitelist.py", "--min-confidence", "60"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
