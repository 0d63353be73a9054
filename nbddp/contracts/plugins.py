"""What other installed packages register with nbddp: ``module:attribute`` by name, per entry-point group
(``nbddp.launchers``, ``nbddp.engines``), and what this process registers itself (:func:`register`).

Reading entry points scans every installed distribution (tens of milliseconds), so a group is read once per process,
when a registry is first asked for something a run needs — never at import, nor for ``--help``.
"""

from __future__ import annotations

import functools


@functools.cache
def registered(group: str) -> dict[str, str]:
    """Name → ``module:attribute`` of what installed packages register under ``group``."""
    from importlib.metadata import entry_points

    return {entry.name: entry.value for entry in entry_points(group=group)}


def register(group: str, name: str, target: str) -> None:
    """``target`` (``module:attribute``) registered under ``name`` in ``group`` for the rest of this process, over an
    installed package's entry point of that name: a registry's ``register()`` (a plugin tried from a notebook,
    before it is packaged)."""
    registered(group)[name] = target
