"""No import from where others write: nbddp's processes never take a module from the notebook's folder.

The folder a notebook is run from may be a shared project folder others can write (mode 1777 here). A ``typing.py``
or an ``nbddp.py`` planted there must not run inside what nbddp starts: its launchers, the warm ranks' starter and
agent, the ranks before the user's code, nor nbddp's own imports in the kernel it starts. The planted modules here
write a mark and fail, so that a process that imported one says so twice. (The user's own cells still import the
notebook's modules, as in any Jupyter kernel: that is their code, not nbddp's.)

Here, each way nbddp starts an interpreter; through the real doors, in runs other tests make anyway: ``nbddp run``
with nbddp's own starter (tests/test_shared_machine.py, the run it probes from another uid, whose notebook imports
neither name), torchrun's launcher (tests/test_faults.py, ``--max-restarts``) and a kernel's warm ranks and their
starter (tests/test_shared_machine.py, the idle pool).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nbddp.contracts.interpreter import code_argv, module_argv, program_argv

PLANTED = """import sys
with open({mark!r}, "a") as f:
    f.write("{name} imported by " + repr(sys.argv) + "\\n")
raise ImportError("a planted {name}")
"""


def plant(folder: Path, *names: str) -> Path:
    """``folder`` made world-writable (sticky, as /tmp) with ``names`` planted in it; the mark they write when
    imported (beside the folder: its path is in no process's module path)."""
    mark = folder.parent / f"{folder.name}-planted-mark"
    folder.mkdir(exist_ok=True)
    folder.chmod(0o1777)
    for name in names:
        (folder / name).write_text(PLANTED.format(mark=str(mark), name=name))
    return mark


def shared_folder(tmp_path: Path, *names: str) -> tuple[Path, Path]:
    """A world-writable folder in ``tmp_path`` with ``names`` planted in it, and the mark they write."""
    folder = tmp_path / "shared"
    return folder, plant(folder, *names)


def planted_imports(mark: Path) -> str:
    return mark.read_text() if mark.exists() else ""


def test_nbddps_interpreters_start_without_the_working_folder_on_the_path(tmp_path):
    folder, mark = shared_folder(tmp_path, "nbddp.py", "typing.py", "json.py")
    # (another name of this interpreter: one nbddp doesn't ask, which gets the bootstrap that every Python runs)
    other = os.path.join(os.path.dirname(sys.executable), ".", os.path.basename(sys.executable))
    for python in (sys.executable, other):
        for argv in (module_argv("nbddp.contracts.ports", "", python=python),
                     code_argv("import json, typing, nbddp; print(nbddp.__file__)", python=python),
                     program_argv(["-m", "json.tool", "--help"], python=python, flags=("-u",))):
            done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, (argv, done.stderr)
    assert planted_imports(mark) == ""
    unsafe = subprocess.run([sys.executable, "-m", "nbddp.contracts.ports", ""], cwd=folder, capture_output=True,
                            text=True, timeout=60)
    assert unsafe.returncode != 0 and "nbddp.py imported" in planted_imports(mark)  # (what the plain -m does)
