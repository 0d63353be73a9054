"""How nbddp starts a Python interpreter: never with a folder others may write first on its module path.

``python -m MODULE`` and ``python -c CODE`` put the working folder first on ``sys.path``, and nbddp starts its
processes (launchers, the warm ranks' starter and agent, a detached run's supervisor, a batch's runs) in the
notebook's folder, where its ranks work. A ``typing.py`` or ``torch.py`` another user wrote into a shared project
folder would run inside them, as the user who runs nbddp. Python 3.11's ``-P`` leaves that folder out (Jupyter's
kernel launcher drops it by hand); on an older interpreter, a bootstrap of one line does it before anything is
imported. The user's code still finds the notebook's modules: each rank puts its folder on the path once nbddp's own
imports are done (:func:`nbddp.rank_side.process.use_notebook_folder`), as a kernel does.

Not ``PYTHONSAFEPATH=1``: a variable is inherited, and would change how the user's own subprocesses find modules.
"""

from __future__ import annotations

import sys
from typing import Sequence

#: What an interpreter older than 3.11 runs first, instead of ``-m MODULE`` (then ``runpy`` runs the module as
#: ``-m`` would: ``sys.argv[0]`` its file, the rest the arguments). The working folder ``-c`` put first goes, where it
#: is there (``PYTHONSAFEPATH`` leaves it out).
_BOOTSTRAP_MODULE = ("import sys; sys.path[:1] = [] if sys.path[:1] == [''] else sys.path[:1]; import runpy; "
                     "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def has_safe_path(python: str = sys.executable) -> bool:
    """Whether ``python`` takes ``-P``: known for this interpreter; another (a cluster node's ``python``) is asked
    nothing, and gets the bootstrap, which every Python runs."""
    return python == sys.executable and sys.version_info >= (3, 11)


def module_argv(module: str, *args: str, python: str = sys.executable, flags: Sequence[str] = ()) -> list[str]:
    """``python FLAGS -m MODULE ARGS`` without the working folder on the module path."""
    if has_safe_path(python):
        return [python, "-P", *flags, "-m", module, *args]
    return bootstrapped_module_argv(module, *args, python=python, flags=flags)


def bootstrapped_module_argv(module: str, *args: str, python: str = sys.executable,
                             flags: Sequence[str] = ()) -> list[str]:
    """``python FLAGS -m MODULE ARGS`` with the working folder off the module path while the module is found and
    imports, but not for good, as ``-P`` would: for a process that puts the folder back itself once its own imports
    are done (a Jupyter kernel, whose IPython adds it for the notebook's modules unless ``-P`` was given)."""
    return [python, *flags, "-c", _BOOTSTRAP_MODULE, module, *args]


def code_argv(code: str, *args: str, python: str = sys.executable) -> list[str]:
    """``python -c CODE ARGS`` without the working folder on the module path."""
    if has_safe_path(python):
        return [python, "-P", "-c", code, *args]
    return [python, "-c", f"import sys; del sys.path[0]\n{code}", *args]


def program_argv(program: Sequence[str], python: str = sys.executable, flags: Sequence[str] = ()) -> list[str]:
    """``python FLAGS PROGRAM``, where ``PROGRAM`` is ``-m MODULE ARGS`` or ``SCRIPT ARGS``: the module's way, or a
    script's, whose own folder (a run dir: nbddp's, private) is all a script puts on the path, with ``-P`` none."""
    if program and program[0] == "-m":
        return module_argv(program[1], *program[2:], python=python, flags=flags)
    return [python, *(("-P",) if has_safe_path(python) else ()), *flags, *program]
