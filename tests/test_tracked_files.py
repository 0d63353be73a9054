"""No committed file holds the paths of the machine it was made on.

A recorded output, a traceback pasted into a document or a comment that names where this machine keeps its
interpreter and its packages (pyenv's versions folder, a venv's site-packages, in full) is right on one machine
only: a test comparing against it fails in any other install, and a reader learns nothing from it. Paths into an
installation are written with ``…`` (``…/site-packages/torch/…``) or normalised where they are compared
(tests/papermill_parity.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: An absolute path into an installation's packages or standard library, or pyenv's interpreters.
INSTALLED = re.compile(r"(?:/[^\s/:'\"`\\]+)+/(?:site|dist)-packages/|(?:/[^\s/:'\"`\\]+)+/lib/python3\.\d+/"
                       r"|\.pyenv/versions/\d")


def this_machines_paths() -> list[str]:
    """Where this checkout, this interpreter and this user's home are (as text a file could hold)."""
    places = {str(REPO), sys.prefix, sys.base_prefix, str(Path.home())}
    return sorted(p + "/" for p in places if p.count("/") >= 2 or p == str(Path.home()) != "/")


def tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of committed files")
    return [REPO / name for name in listed.stdout.decode().split("\0") if name]


def test_no_committed_file_holds_an_installation_path_or_this_machines():
    literal = this_machines_paths()
    found = []
    for path in tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # (a wheel, an image)
        for number, line in enumerate(text.splitlines(), 1):
            hits = [m.group(0) for m in INSTALLED.finditer(line)] + [p for p in literal if p in line]
            if hits:
                found.append(f"{path.relative_to(REPO)}:{number}: {hits[0]}")
    assert not found, "committed files name where a machine installed things (write …/ instead):\n" + "\n".join(found)


def test_the_pattern_finds_what_it_is_for():
    lib = "/lib/" + "python3.12/"  # (written in two: this file is committed too)
    assert INSTALLED.search(f'File "/opt/venv{lib}site-packages/torch/x.py", line 3')
    assert INSTALLED.search(f"/usr{lib}json/__init__.py")
    assert INSTALLED.search("~/.pyenv/" + "versions/3.13.0/bin/python")
    assert not INSTALLED.search("…/site-packages/torch/distributed/distributed_c10d.py")
    assert not INSTALLED.search("pip install -e '.[test]'")
