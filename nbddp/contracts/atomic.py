"""Files another process may read while they are written: whole or not at all.

Every file nbddp writes for another process to read (``result.json``, the live-run registry, the
warm pool's job and ending files, the nodes' roster, a Slurm job's record, checkpoints, executed
notebooks) goes through :func:`replace_atomically`: the content is written to a temporary file in
the same folder, then renamed over the target, which POSIX makes atomic. A reader sees the old
file or the new one, never half of one; a writer killed mid-write leaves the old file in place,
and the next writer of the same name removes the partial file it left.

Like ``torch.save`` and ``json.dump``, nothing here ``fsync``-s: the guarantee is against other
processes and crashes of the writer, not against the machine losing power.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

_SUFFIX = ".partial"


def replace_atomically(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(temporary path)``, then rename the temporary file over ``path``.

    The temporary file is named ``.NAME.PID.XXXX.partial`` beside ``path``; partial files of the same
    name whose writer process is gone are removed first (a writer killed mid-save).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, ordinary_mode())  # mkstemp's 0600, else: the same file written with open() has the umask's
    finally:
        os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str, mode: int | None = None) -> Path:
    """``text`` (UTF-8) to ``path``, atomically, with permissions ``mode`` (``None``: :func:`ordinary_mode`)."""

    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")
        if mode is not None:
            tmp.chmod(mode)

    return replace_atomically(path, write)


def write_json(path: str | Path, data: Any, indent: int | None = None) -> Path:
    """``data`` as JSON (``repr`` for what JSON can't hold), atomically."""
    return write_text(path, json.dumps(data, indent=indent, default=repr))


def ordinary_mode() -> int:
    """The permissions ``open()`` gives a new file here: ``0o666`` less the process's umask.

    Every file nbddp writes has them, whether written whole at once or not (``weights.pt``, ``result.json``,
    ``output.ipynb`` and the logs alike); what must stay the user's alone is in a folder only they can
    enter (a run dir, a warm pool's, the registry: ``0700``). The umask is read from ``/proc``: setting it
    to learn it (``os.umask``) would change it for a moment under every other thread of a kernel.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


def read_json(path: str | Path) -> Any:
    """What :func:`write_json` wrote to ``path``; ``None`` when there is nothing (yet) or it isn't JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _remove_orphans(path: Path) -> None:
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*{_SUFFIX}"):
        pid = stale.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
