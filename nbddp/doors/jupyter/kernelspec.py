"""``nbddp kernel install`` and ``nbddp kernel remove``: the nbddp kernel's Jupyter kernelspec.

The kernel is ipykernel's own (its kernelspec's resources, metadata and protocol: ipykernel's ``write_kernel_spec``),
started through :mod:`nbddp.doors.jupyter.kernel_start` with this Python, which starts the warm ranks' starter
first.
Its module is found with the working folder off the module path (the folder a notebook opens in is anyone's to fill
on a shared machine), which IPython then puts back for the notebook's own modules, as ipykernel's launcher does.

A notebook saved with this kernel names it (``"kernelspec": {"name": "nbddp"}``): where it isn't installed, Jupyter
asks for another kernel, ``papermill -k python3`` runs it; nbddp's own commands run it in this Python's plain kernel
everywhere (:func:`nbddp.doors.notebook_kernel.kernel_for`), since beside a job the nbddp kernel starts nothing.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from nbddp.contracts.errors import UsageError
from nbddp.contracts.interpreter import bootstrapped_module_argv

#: The kernelspec's name: what a notebook saved with the kernel names in its metadata.
KERNEL_NAME = "nbddp"
DISPLAY_NAME = f"Python {sys.version_info[0]} (nbddp)"
MODULE = "nbddp.doors.jupyter.kernel_start"


def kernel_argv(python: str = sys.executable) -> list[str]:
    """The kernelspec's ``argv``: the kernel's module with ``{connection_file}`` (filled in by Jupyter). CPython's
    frozen standard modules are off, as ``python -m ipykernel install`` has them, so that the kernel's debugger
    (``"debugger": true``) can step into them."""
    flags = ("-Xfrozen_modules=off",) if platform.python_implementation() == "CPython" else ()
    return bootstrapped_module_argv(MODULE, "-f", "{connection_file}", python=python, flags=flags)


def install(prefix: str | None = None) -> Path:
    """Install the kernelspec for this Python: for this user (``~/.local/share/jupyter/kernels/nbddp``), or under
    ``prefix`` (``sys.prefix`` for this environment's own Jupyter); one already there is replaced. Returns its folder.

    Raises:
        UsageError: the folder can't be written (a system prefix, without the rights).
    """
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager

    staging = Path(tempfile.mkdtemp(prefix="nbddp-kernelspec-"))
    try:
        source = write_kernel_spec(staging / KERNEL_NAME,
                                   overrides={"argv": kernel_argv(), "display_name": DISPLAY_NAME})
        try:
            return Path(KernelSpecManager().install_kernel_spec(source, KERNEL_NAME, user=prefix is None,
                                                                prefix=prefix))
        except OSError as exc:
            raise UsageError(f"could not install the nbddp kernel: {exc.strerror or exc}"
                             f"{f' ({exc.filename})' if exc.filename else ''}: give --user, or a --prefix you "
                             "can write.") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def installed() -> Path | None:
    """The nbddp kernelspec's folder Jupyter would use here (``None``: not installed)."""
    from jupyter_client.kernelspec import KernelSpecManager

    found = KernelSpecManager().find_kernel_specs().get(KERNEL_NAME)
    return Path(found) if found else None


def folder_for(prefix: str | None) -> Path:
    """Where :func:`install` puts the kernelspec: this user's Jupyter data folder, or ``prefix``'s, as Jupyter's
    ``KernelSpecManager.install_kernel_spec`` does."""
    from jupyter_core.paths import jupyter_data_dir

    return (Path(prefix) / "share" / "jupyter" if prefix else Path(jupyter_data_dir())) / "kernels" / KERNEL_NAME


def installed_in(prefix: str | None) -> bool:
    """Whether a kernelspec is where :func:`install` with this ``prefix`` puts it (found by Jupyter or not)."""
    return (folder_for(prefix) / "kernel.json").is_file()


def remove(prefix: str | None = None, user: bool = False) -> Path:
    """Remove the nbddp kernelspec: the one Jupyter would use here, or the one installed for this user (``user``) or
    under ``prefix``, which a Jupyter started without that prefix's ``JUPYTER_PATH`` doesn't find. Returns its folder.

    Raises:
        UsageError: none is installed there, or its folder can't be removed.
    """
    if prefix is None and not user:
        folder = installed()
        if folder is None:
            raise UsageError("no nbddp kernel that Jupyter finds is installed here (jupyter kernelspec list shows the "
                             "kernels); one installed with --prefix PATH is removed with `nbddp kernel remove "
                             "--prefix PATH`.")
    else:
        folder = folder_for(prefix)
        if not installed_in(prefix):
            raise UsageError(f"no nbddp kernel is installed in {folder.parent}.")
    try:
        shutil.rmtree(folder)
    except OSError as exc:
        raise UsageError(f"could not remove the nbddp kernel at {folder}: {exc.strerror or exc}.") from None
    return folder


def _where_options(parser: argparse.ArgumentParser, verb: str) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true",
                       help=f"{verb} this user's kernels, which every Jupyter of this user finds"
                            f"{' (the default)' if verb == 'in' else ''}")
    where.add_argument("--sys-prefix", action="store_true",
                       help=f"{verb} this environment's kernels ({sys.prefix}), which a Jupyter installed in it finds")
    where.add_argument("--prefix", metavar="PATH",
                       help=f"{verb} PATH/share/jupyter/kernels, which a Jupyter finds with "
                            "JUPYTER_PATH=PATH/share/jupyter")


def add_kernel_commands(parser: argparse.ArgumentParser) -> None:
    """``nbddp kernel install [--user | --sys-prefix | --prefix PATH]`` and ``nbddp kernel remove [the same]``."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    put = actions.add_parser(
        "install", help="install the nbddp kernel for this Python (for this user by default)",
        description="Install the nbddp kernel, 'Python 3 (nbddp)': ipykernel's kernel, which starts the warm ranks' "
                    "starter as it starts, so that a notebook's first %%ddp_train run right after its first cells "
                    "waits for less. One already there is replaced.")
    _where_options(put, "in")
    take = actions.add_parser(
        "remove", help="remove the nbddp kernel Jupyter finds here (or the one --user, --sys-prefix, --prefix name)",
        description="Remove the nbddp kernel: the one Jupyter finds here, or the one installed where --user, "
                    "--sys-prefix or --prefix says (as it was installed).")
    _where_options(take, "from")


def kernel_command(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """What ``nbddp kernel ACTION`` does, said in a line or two."""
    prefix = sys.prefix if args.sys_prefix else args.prefix
    where = " --sys-prefix" if args.sys_prefix else f" --prefix {shlex.quote(args.prefix)}" if args.prefix else ""
    if args.action == "remove":
        say(f"nbddp: removed the nbddp kernel ({remove(prefix=prefix, user=args.user)})")
        other = installed()
        if other is not None:
            say(f"nbddp: another nbddp kernel is installed, at {other}: `nbddp kernel remove` again removes it")
        return 0
    replaced = installed_in(prefix)
    folder = install(prefix=prefix)
    say(f"nbddp: {'replaced' if replaced else 'installed'} the nbddp kernel, {DISPLAY_NAME!r} (running "
        f"{sys.executable}), in {folder}")
    say("nbddp: a notebook in it starts the warm ranks' starter as its kernel starts: a first %%ddp_train run right "
        f"after the notebook's first cells (Restart and Run All) waits for less. `nbddp kernel remove{where}` removes "
        "it.")
    found = installed()
    if found is None or found.resolve() != folder.resolve():
        say(f"nbddp: Jupyter here {f'finds another nbddp kernel first, at {found}' if found else 'does not find it'}"
            f": give JUPYTER_PATH={folder.parent.parent} to the Jupyter that should find it")
    return 0
