"""Processes and process groups: is anything still running, and the one way nbddp stops them.

psutil reads the process table (zombies, which ``kill(pid, 0)`` can't tell from running
processes, count as gone). :func:`stop_groups` is the one terminate → grace → kill sequence,
used by the job's launch, by ``nbddp kill`` and by ``nbddp batch``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, Iterable

import psutil


def process_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` is running."""
    try:
        os.killpg(pgid, 0)  # cheap answer for a group that is entirely gone
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return False


def memory_held(pid: int) -> int:
    """Bytes of memory process ``pid`` and its descendants hold, each counting its share of the pages they
    share (their proportional set sizes, where the system tells them; else resident sizes): what they cost the
    machine together, not counting torch's pages once per forked rank. 0 for a process gone."""
    try:
        processes = [psutil.Process(pid)]
        processes += processes[0].children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0
    held = 0
    for process in processes:
        try:
            info = process.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        held += getattr(info, "pss", info.rss)
    return held


#: Seconds between the SIGTERM that stops a process nbddp started here (a rank, a launcher) and the SIGKILL for
#: what is left: long enough for a rank to leave its group and flush its log. A launcher that needs longer says
#: so (:attr:`nbddp.launchers.base.Launcher.stop_grace`: Slurm's cancel, Ray's actors); every stop takes it from there.
STOP_GRACE = 5.0
#: What a whole run (``nbddp run``'s process, a detached run's supervisor) needs beyond its launcher's stop grace
#: once signalled: to stop its kernel and record how the run ended.
RECORD_SECONDS = 7.0


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(pgids: Iterable[int], sig: int = signal.SIGTERM, grace: float = STOP_GRACE,
                reap: Callable[[], None] = lambda: None) -> bool:
    """Send ``sig`` to every group, give them ``grace`` seconds, SIGKILL what is left.

    ``reap`` is called while waiting (a parent reaps its own children's zombies there).
    Returns True when no process of any group is left.
    """
    pgids = list(pgids)
    for pgid in pgids:
        signal_group(pgid, sig)
    if not _wait_gone(pgids, grace, reap):
        for pgid in pgids:
            signal_group(pgid, signal.SIGKILL)
        return _wait_gone(pgids, 4.0, reap)
    return True


def _wait_gone(pgids: list[int], seconds: float, reap: Callable[[], None]) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        reap()
        if not any(group_alive(pgid) for pgid in pgids):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


#: The longest folder path :func:`owned_temp_dir` gives for sockets: a Unix socket's path holds 107 bytes,
#: and the kernel's IPC sockets are ``FOLDER/k-NNNNN``.
SOCKET_FOLDER_LENGTH = 90


def owned_temp_dir(prefix: str, for_sockets: bool = False) -> str:
    """A private temp folder named after this process (``PREFIX<pid>-XXXX``).

    Its owner removes it when done; one killed outright (SIGKILL) can't, so this first removes the
    folders of the same prefix whose owning process no longer exists. ``for_sockets``: its path must be
    short enough for a Unix socket in it (JupyterHub and batch systems set long ``TMPDIR``s): where the
    temp folder's path is too long, ``/tmp`` holds it (a private folder all the same).
    """
    import shutil
    import tempfile
    from pathlib import Path

    root = tempfile.gettempdir()
    if for_sockets and len(os.path.join(root, f"{prefix}{os.getpid()}-XXXXXXXX")) > SOCKET_FOLDER_LENGTH \
            and os.access("/tmp", os.W_OK | os.X_OK):
        root = "/tmp"
    for stale in Path(root).glob(f"{prefix}*-*"):
        try:
            pid = int(stale.name[len(prefix):].split("-", 1)[0])
            if stale.stat().st_uid == os.getuid() and not process_alive(pid):
                shutil.rmtree(stale, ignore_errors=True)
        except (ValueError, OSError):
            continue
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)
