"""Is a process, or any process of a group, still running? Read from /proc, zombies excluded.

``kill(pid, 0)`` also succeeds for zombies waiting to be reaped, so it can't
tell a finished rank from a running one; /proc's state field can.
"""

from __future__ import annotations

import os


def _stat(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    fields = _stat(pid)
    if fields is not None:
        return fields[0] != "Z"
    if os.path.isdir("/proc"):
        return False
    try:  # no /proc (not Linux): the best we can do
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` is running."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(entry)
            if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False
