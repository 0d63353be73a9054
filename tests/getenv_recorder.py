"""What a process reads of its environment: a shared library, ``LD_PRELOAD``-ed, built with the C compiler, whose
``getenv`` and ``secure_getenv`` append each name asked for to the file ``GETENV_RECORD`` names (then answer as the C
library's do); and, for Python's own reads, an ``os.environ`` that notes each name looked up by key.

Together they say which variables an import reads at all: C libraries (libgomp, OpenBLAS, libtorch) call ``getenv``
as they load; Python code reads ``os.environ``. (A module that walks the whole environment, as tqdm does for its
``TQDM_`` variables, is not counted as reading every name.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void note(const char *name) {
    static char *(*real)(const char *);
    if (!real) real = (char *(*)(const char *))dlsym(RTLD_NEXT, "getenv");
    const char *path = real("GETENV_RECORD");
    if (!path || !name) return;
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0600);
    if (fd < 0) return;
    write(fd, name, strlen(name));
    write(fd, "\n", 1);
    close(fd);
}

char *getenv(const char *name) {
    static char *(*real)(const char *);
    if (!real) real = (char *(*)(const char *))dlsym(RTLD_NEXT, "getenv");
    note(name);
    return real(name);
}

char *secure_getenv(const char *name) {
    static char *(*real)(const char *);
    if (!real) real = (char *(*)(const char *))dlsym(RTLD_NEXT, "secure_getenv");
    note(name);
    return real(name);
}
"""

#: Run first in the recorded Python process: its ``os.environ`` notes the names it is asked for into ``READ``.
PYTHON_SIDE = r"""
import os, sys
READ = set()
class _Noting(type(os.environ)):
    def __getitem__(self, name):
        caller = sys._getframe(1).f_code
        if not (caller.co_name == "__iter__" and "_collections_abc" in caller.co_filename):  # (a walk over them all)
            READ.add(name)
        return super().__getitem__(name)
    def __contains__(self, name):
        READ.add(name)
        return super().__contains__(name)
os.environ.__class__ = _Noting
"""


def build(folder: Path) -> Path:
    """The library, built in ``folder``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("a C compiler (Debian's gcc) builds the getenv recorder: .ci/run installs it")
    library = folder / "getenv_recorder.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), "-x", "c", "-", "-ldl"], input=SOURCE,
                   text=True, check=True)
    return library
