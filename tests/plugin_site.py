"""A package installed the way a plugin of nbddp's is: a folder on ``PYTHONPATH`` holding its module and a
``.dist-info`` whose ``entry_points.txt`` registers it, so that ``importlib.metadata`` finds it as it finds any
installed distribution (nothing of nbddp's registry is patched)."""

from __future__ import annotations

import os
from pathlib import Path


def plugin_environment(folder: Path, module: str, source: str, entry_points: dict[str, dict[str, str]]) -> dict:
    """The environment of a process that has the plugin ``module`` (its ``source``) installed, registering
    ``entry_points`` (group → name → ``module:attribute``); the checkout's nbddp on the path too."""
    info = folder / f"{module}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in names.items())
        for group, names in entry_points.items()))
    (folder / f"{module}.py").write_text(source)
    path = os.pathsep.join(filter(None, [str(folder), str(Path(__file__).resolve().parent.parent),
                                         os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
