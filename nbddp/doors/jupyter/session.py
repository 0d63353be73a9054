"""Which notebook a kernel runs, to name its runs after it (``runs/<notebook>-<time>``).

Jupyter's protocol never tells a kernel its notebook; what each front end does give it (read from
their sources):

* jupyter-server (JupyterLab, Notebook 7) starts a session's kernel with ``JPY_SESSION_NAME``, the
  notebook's path, in its environment.
* papermill injects ``PAPERMILL_INPUT_PATH`` into the notebook's namespace, but only when asked
  (``--inject-input-path``, ``--inject-paths``); its engine is nbclient's.
* nbclient (``jupyter execute``, papermill) and nbconvert (``--execute``) start the kernel with their
  own environment and send bare execute requests (no notebook, no cell ids). jupyter_client does tell
  the kernel which process started it (``JPY_PARENT_PID``), and when that is one of these commands,
  its command line names the notebook: ``papermill IN.ipynb OUT.ipynb``, ``jupyter nbconvert --execute
  NB.ipynb``, ``jupyter execute NB.ipynb``.

Where none knows (their Python APIs in a program of one's own, several notebooks in one command,
papermill reading stdin), runs are named ``ddp_train``.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath, PureWindowsPath
from typing import Any, Mapping, Sequence

#: What a kernel's runs are named after when nothing knows its notebook.
UNNAMED = "ddp_train"
#: Commands that execute notebooks given on their command line: papermill's first is its input, the others
#: take several (the kernel's is then unknown).
_PAPERMILL = "papermill"
_EXECUTORS = {_PAPERMILL, "jupyter-nbconvert", "nbconvert", "jupyter-execute", "nbclient"}
#: Options of those commands whose value may be a notebook that is not the one executed.
_OUTPUT_OPTIONS = {"--output", "-o"}


def session_notebook(cwd: Path, namespace: Mapping[str, Any] | None = None) -> Path:
    """``<name>.ipynb`` in the kernel's folder, ``<name>`` being its notebook's (:data:`UNNAMED` when unknown).

    ``namespace``: the kernel's user namespace (where papermill injects ``PAPERMILL_INPUT_PATH``)."""
    name = _stem(os.environ.get("JPY_SESSION_NAME")) or _stem((namespace or {}).get("PAPERMILL_INPUT_PATH")) \
        or _stem(notebook_in_command(_launcher_command())) or UNNAMED
    return Path(cwd) / f"{name}.ipynb"


def notebook_in_command(argv: Sequence[str]) -> str | None:
    """The notebook a papermill, nbconvert or ``jupyter execute`` command line executes, if it names one only."""
    for at, arg in enumerate(argv[:4]):  # the interpreter, perhaps ``-m``, then the command
        command = PureWindowsPath(arg).name.lower().removesuffix(".exe").removesuffix("-script.py")  # (\\ or /)
        if command in _EXECUTORS:
            break
    else:
        return None
    notebooks, after = [], argv[at + 1:]
    for i, arg in enumerate(after):
        if arg == "-" and command == _PAPERMILL and not notebooks:
            return None  # papermill reads its input from stdin
        if (arg.lower().endswith(".ipynb") and not arg.startswith("-")
                and (i == 0 or after[i - 1] not in _OUTPUT_OPTIONS)):
            notebooks.append(arg)
    if command == _PAPERMILL:
        return notebooks[0] if notebooks else None
    return notebooks[0] if len(notebooks) == 1 else None


def _launcher_command() -> list[str]:
    """The command line of the process that started this kernel (jupyter_client's ``JPY_PARENT_PID``)."""
    import psutil

    try:
        return psutil.Process(int(os.environ["JPY_PARENT_PID"])).cmdline()
    except (KeyError, ValueError, OSError, psutil.Error):  # no parent named, or gone, or not ours to read
        return []


def _stem(path: Any) -> str:
    """The name of a notebook path (``s3://b/digits.ipynb`` → ``digits``); ``""`` for anything else."""
    if not isinstance(path, str) or not path.strip() or path.strip() == "-":
        return ""
    return PurePath(path.strip().replace("\\", "/")).stem
