"""What nbddp trusts on disk is the user's own and nobody else's to write (DESIGN.md, "Shared machines").

nbddp writes a run into folders (a run dir, a batch's ``--out``, ``runs/`` beside a notebook in a shared
project folder, a warm pool's folder) and later acts on what it reads there: the script its ranks run, a
detached run's request, a sharded checkpoint's metadata (torch pickles it). A folder another user owns, or
can write to, lets them plant a symbolic link that turns one of nbddp's writes onto the victim's own file,
or swap what nbddp reads for something that runs their code as the victim. So, as Jupyter treats its
connection files and ssh its keys:

* the folders nbddp creates are private (0700); one that exists already is used only when it is the user's
  and neither its group nor others can write it, else one line says whose it is, and made private when others
  can read it, saying so (:func:`private_folder`);
* what is read back to be trusted is opened without following a symbolic link and checked the same way
  (:func:`read_owned`); marks are created without following one (:func:`touch`).

Nothing here imports torch; every layer may use it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Callable

from nbddp.contracts.errors import UsageError, see


class NotYours(UsageError):
    """A folder or file nbddp would trust belongs to another user, or another user can write to it."""


#: What a refusal tells the user to do, by default: nbddp's own folders are chosen by the user.
CHOOSE_ANOTHER = "Choose a folder of your own."


def private_folder(path: Path, what: str, parents: bool = False, say: Callable[[str], Any] | None = None) -> Path:
    """``path``, created private (0700), or made private when it is the user's already.

    ``what`` names it in what is said (``--run-dir``, ``the runs folder``); ``parents``: create missing
    parents too (as the user's umask makes them: only ``path`` itself must be private). A folder of the user's that
    others can read (``runs/`` made by hand, 0755) is made private, and ``say`` is told so in one line: a run's
    weights, logs and script are the user's work, and what others can read of them is for the user to share.

    Raises:
        NotYours: it exists and belongs to another user, or its group or others can write to it.
        UsageError: it can't be made there (no such folder, no permission, a read-only file system).
    """
    path = Path(path)
    if parents:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # (FileExistsError too: a file where a folder would be)
            raise _cant_make(what, path, exc) from None
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        info = check_owned(path, what, follow=True)
        if info.st_mode & 0o077:
            os.chmod(path, 0o700)
            if say is not None:
                say(f"{what} {path} could be read by {_who(info.st_mode)} (mode {stat.filemode(info.st_mode)}): "
                    "made it private (0700), as nbddp's folders are; share what you want of it with chmod once the "
                    "run ends.")
    except OSError as exc:
        raise _cant_make(what, path, exc) from None
    return path


def _cant_make(what: str, path: Path, exc: OSError) -> UsageError:
    return UsageError(f"{what} {path} can't be made ({exc.strerror or exc}). {CHOOSE_ANOTHER}")


def _who(mode: int) -> str:
    return "others" if mode & 0o007 else "its group"


def check_owned(path: Path, what: str, follow: bool = False, then: str = CHOOSE_ANOTHER) -> os.stat_result:
    """``path``'s status, once it is known to be the user's and writable by nobody else.

    ``follow``: judge what a symbolic link points to (a folder the user named); otherwise a link is refused
    (a file nbddp reads back must not be one a link redirects). ``then``: what the refusal says to do.

    Raises:
        NotYours: another user owns it, its group or others can write to it, or (``follow`` off) it is a link.
        FileNotFoundError: it doesn't exist.
    """
    info = os.stat(path) if follow else os.lstat(path)
    return _judged(Path(path), info, what, then)


def read_owned(path: Path, what: str) -> bytes:
    """The bytes of ``path``, opened without following a symbolic link and read only when it is the user's
    alone (so a file swapped in by someone else, or a link to theirs, is never acted on).

    Raises:
        NotYours: as :func:`check_owned`. OSError: it can't be read (``FileNotFoundError``: it isn't there).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if Path(path).is_symlink():
            raise NotYours(f"{what} {path} is a symbolic link: nbddp doesn't follow one to a file it trusts. "
                           "Remove it; if someone else put it there, tell them or your administrator.") from exc
        raise
    with os.fdopen(fd, "rb") as file:
        _judged(Path(path), os.fstat(file.fileno()), what)
        return file.read()


def touch(path: Path) -> None:
    """Create the mark ``path`` (or leave it as it is), never through a symbolic link planted there."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666))


def _judged(path: Path, info: os.stat_result, what: str, then: str = CHOOSE_ANOTHER) -> os.stat_result:
    if stat.S_ISLNK(info.st_mode):
        raise NotYours(f"{what} {path} is a symbolic link: nbddp doesn't follow one to a file it trusts. Remove it; "
                       "if someone else put it there, tell them or your administrator.")
    if info.st_uid != os.getuid():
        raise NotYours(f"{what} {path} belongs to uid {info.st_uid} ({_user(info.st_uid)}), not to you: nbddp only "
                       f"writes into and acts on what it reads from what is yours. {then}"
                       + see("a-folder-that-belongs-to-another-user-or-that-others-can-write"))
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        writable = "others" if info.st_mode & stat.S_IWOTH else "its group"
        raise NotYours(f"{what} {path} can be written by {writable} (mode {stat.filemode(info.st_mode)}): anyone who "
                       f"can write there could change what nbddp runs. Make it yours alone (chmod go-w {path}), or "
                       f"{then[0].lower()}{then[1:]}"
                       + see("a-folder-that-belongs-to-another-user-or-that-others-can-write"))
    return info


def _user(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return "another user"
