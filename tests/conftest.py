"""Shared fixtures: notebooks written with nbformat, and process-leak checks."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Iterable

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "notebooks"
FIXTURES = Path(__file__).resolve().parent / "notebooks"


def code(source: str, *tags: str):
    return new_code_cell(source, metadata={"tags": list(tags)} if tags else {})


def md(source: str):
    return new_markdown_cell(source)


def write_notebook(path: Path, cells: Iterable) -> Path:
    """Write a valid v4 notebook (validated, as every notebook a test writes must be)."""
    nb = new_notebook(cells=list(cells), metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return path


@pytest.fixture
def notebook(tmp_path):
    """``notebook(cells, name=...)`` → path of a notebook written in ``tmp_path``."""

    def make(cells, name: str = "nb.ipynb") -> Path:
        return write_notebook(tmp_path / name, cells)

    return make


def descendants(pid: int) -> set[int]:
    """PIDs of every live descendant of ``pid``, read from /proc (by PID, not by name)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> set[int]:
    """Live processes in process group ``pgid``."""
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.add(int(entry))
    return members


def survivors(pgid: int, grace: float = 3.0) -> set[int]:
    """Members of ``pgid`` still alive after ``grace`` seconds (helpers like
    multiprocessing's resource tracker exit a moment after their parent)."""
    import time

    deadline = time.monotonic() + grace
    while (members := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return members


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


PYTHON = sys.executable
