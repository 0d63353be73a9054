"""The nbddp kernel's kernelspec (``nbddp kernel install``, ``nbddp kernel remove``), installed for real with Jupyter's
own KernelSpecManager into the test's folders (``JUPYTER_DATA_DIR``: the user's, ``JUPYTER_PATH``: where Jupyter
looks first), and found back by it. Its kernel starting the starter is tests/test_preload.py's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from jupyter_client.kernelspec import KernelSpecManager

from nbddp.doors.cli import main
from nbddp.doors.jupyter.kernelspec import DISPLAY_NAME, KERNEL_NAME, kernel_argv


@pytest.fixture
def jupyter_dirs(tmp_path, monkeypatch):
    """This user's Jupyter data folder, and no other folder Jupyter would look in first, both the test's."""
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "user"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "path"))
    return tmp_path


def test_install_writes_ipykernels_spec_with_the_nbddp_kernels_module_for_this_user_and_remove_takes_it_away(
        jupyter_dirs, capsys):
    assert main(["kernel", "install"]) == 0
    folder = jupyter_dirs / "user" / "kernels" / KERNEL_NAME
    said = capsys.readouterr().err
    assert f"installed the nbddp kernel, {DISPLAY_NAME!r} (running {sys.executable}), in {folder}" in said, said
    assert "JUPYTER_PATH" not in said, said
    spec = json.loads((folder / "kernel.json").read_text())
    assert spec["argv"] == kernel_argv() and spec["argv"][0] == sys.executable and "{connection_file}" in spec["argv"]
    assert "-Xfrozen_modules=off" in spec["argv"]  # (as ipykernel's install: its debugger steps into the stdlib)
    assert spec["display_name"] == DISPLAY_NAME and spec["language"] == "python"
    assert spec["metadata"]["debugger"] is True and (folder / "logo-64x64.png").exists()  # (ipykernel's own spec)
    assert KernelSpecManager().find_kernel_specs()[KERNEL_NAME] == str(folder)

    assert main(["kernel", "install"]) == 0  # again: replaced, the same
    assert f"replaced the nbddp kernel, {DISPLAY_NAME!r}" in capsys.readouterr().err
    assert json.loads((folder / "kernel.json").read_text()) == spec
    assert main(["kernel", "remove"]) == 0
    assert f"removed the nbddp kernel ({folder})" in capsys.readouterr().err and not folder.exists()
    if KERNEL_NAME not in KernelSpecManager().find_kernel_specs():  # (none in this environment's own folders)
        assert main(["kernel", "remove"]) == 2
        assert ("nbddp: error: no nbddp kernel that Jupyter finds is installed here (jupyter kernelspec list shows "
                "the kernels); one installed with --prefix PATH is removed with `nbddp kernel remove --prefix PATH`"
                ) in capsys.readouterr().err


def test_a_prefix_jupyter_doesnt_look_in_is_said_with_the_jupyter_path_that_finds_it_and_removed_from_there(jupyter_dirs, capsys):
    assert main(["kernel", "install", "--prefix", str(jupyter_dirs / "env")]) == 0
    said = capsys.readouterr().err
    share = jupyter_dirs / "env" / "share" / "jupyter"
    assert f"in {share / 'kernels' / KERNEL_NAME}" in said, said
    assert f"Jupyter here does not find it: give JUPYTER_PATH={share} to the Jupyter that should find it" in said
    assert f"`nbddp kernel remove --prefix {jupyter_dirs / 'env'}` removes it" in said
    with pytest.raises(SystemExit, match="2"):  # (one place only)
        main(["kernel", "install", "--prefix", str(jupyter_dirs / "env"), "--user"])
    blocked = jupyter_dirs / "blocked"
    blocked.write_text("")  # (a file where the folder should be)
    assert main(["kernel", "install", "--prefix", str(blocked)]) == 2
    assert "nbddp: error: could not install the nbddp kernel:" in capsys.readouterr().err
    # removed from where it was installed, which this Jupyter doesn't look in
    assert main(["kernel", "remove", "--prefix", str(jupyter_dirs / "env")]) == 0
    assert f"removed the nbddp kernel ({share / 'kernels' / KERNEL_NAME})" in capsys.readouterr().err
    assert not (share / "kernels" / KERNEL_NAME).exists()
    assert main(["kernel", "remove", "--prefix", str(jupyter_dirs / "env")]) == 2
    assert f"nbddp: error: no nbddp kernel is installed in {share / 'kernels'}." in capsys.readouterr().err


def test_the_kernels_module_is_found_with_the_working_folder_off_the_path(tmp_path):
    """A notebook's folder is anyone's to fill on a shared machine: an ``nbddp`` package there is not the one the
    kernel runs. (``--help``: the kernel's own options, its module having run; no kernel starts.)"""
    planted = tmp_path / "nbddp"
    planted.mkdir()
    (planted / "__init__.py").write_text("raise SystemExit('PLANTED')\n")
    argv = [part for part in kernel_argv() if part not in ("-f", "{connection_file}")]
    out = subprocess.run([*argv, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "PLANTED" not in out.stdout + out.stderr, out.stderr
    assert "ipython-kernel" in out.stdout, out.stdout  # (IPKernelApp's help)
