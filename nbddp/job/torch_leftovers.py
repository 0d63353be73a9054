"""The empty folder torch leaves in the temp folder, removed after a run that made it.

Every rank that wraps a model in ``DistributedDataParallel`` imports ``torch._dynamo``, and that import
creates the compile cache's folder, ``<temp folder>/torchinductor_<user>`` (torch's
``cache_dir_utils.default_cache_dir``), empty unless something compiles: a hand-written torchrun run
leaves it too. A run that made it and left it empty has it removed when it ends; a folder that existed
before, or holds a compile cache (``torch.compile`` in the training cell), stays where torch keeps it,
and ``TORCHINDUCTOR_CACHE_DIR`` (a folder the user chose) is never touched. Torch makes the folder
again whenever it writes to its cache, so removing an empty one can't take anything from a run.
"""

from __future__ import annotations

import getpass
import os
import re
import tempfile
from pathlib import Path


def inductor_cache_folder(environ: dict[str, str] | os._Environ = os.environ) -> Path | None:
    """Where the ranks' torch puts its compile cache by default; ``None`` when the user chose the folder."""
    if environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    try:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # as torch names it
    except (KeyError, OSError):  # no user name for this uid: torch would fail the same way, differently
        return None
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}"


class TorchLeftovers:
    """Notes, as a run starts, whether torch's cache folder exists; :meth:`clean` removes it if the run made it
    and nothing is in it."""

    def __init__(self) -> None:
        self.folder = inductor_cache_folder()
        self.existed = self.folder is None or self.folder.exists()

    def clean(self) -> None:
        if self.existed or self.folder is None:
            return
        try:
            self.folder.rmdir()  # only an empty folder: a cache written meanwhile stays
        except OSError:
            pass
