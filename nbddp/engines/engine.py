"""What an engine is, as one record (:class:`Engine`), and the lines it adds to a script (:class:`EngineCode`).

Every fact nbddp knows about an engine — the packages that mark a notebook as its, how its notebooks are
told apart, the code it puts around the cells, whether it spawns its own ranks, what it refuses, how it
counts processes — is a field of its record, which lives with the engine's code (:mod:`.torch`,
:mod:`.catalyst`, :mod:`.frameworks`) and is registered by name (:data:`nbddp.engines.BUILTIN`), as
launchers are. Adding an engine is its module and one registry line; nothing else restates it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol


class CodeCell(Protocol):
    """What an engine reads of a chosen cell (:class:`nbddp.notebook.roles.ExportedCell` is one): its role and
    code. A protocol, so that the engines sit below the notebook side that asks them."""

    @property
    def role(self) -> str: ...

    @property
    def code(self) -> str: ...


@dataclass(frozen=True)
class EngineCode:
    """Lines an engine puts around the user's cells."""

    imports: tuple[str, ...]
    """Module level, before the first cell: runs in every rank (and every spawned child)."""
    train_prologue: tuple[str, ...]
    """First lines under the ``__main__`` guard."""
    train_epilogue: tuple[str, ...]
    """Last lines under the guard: hand the returned variables back."""
    launch_hint: str
    """The command that launches the script by hand, for its header."""
    notes: tuple[str, ...] = ()
    """More header lines: what a user running it by hand must know."""


@dataclass(frozen=True)
class CodeRequest:
    """What a script asks of its engine's code: the variables it returns, its file's name, whether
    ``nbddp.prepare(model)`` shards (``--shard``), and for a library the packages of it the cells import."""

    returns: tuple[str, ...]
    script_name: str
    shard: bool = False
    packages: tuple[str, ...] = ()


@dataclass(frozen=True)
class CellFacts:
    """What detection reads of the chosen cells, read once for every engine asked."""

    imported: frozenset[str]
    """Top-level packages any cell imports."""
    called: frozenset[str]
    """Names any cell calls (``f`` for ``f(...)`` and ``x.f(...)``)."""
    trained: frozenset[str]
    """Names the training cells call."""
    train_codes: tuple[str, ...]
    """The training cells' code."""


#: ``(function names, keyword, position among the positional arguments)``: a call whose literal process count a
#: run takes (``notebook_launcher(fn, args, num_processes)``).
ProcessCount = tuple[tuple[str, ...], str, "int | None"]


@dataclass(frozen=True)
class LaunchCall:
    """One call of a cell's running code (not a ``def`` body), with what the notebook so far says about it."""

    call: ast.Call
    name: str
    """What it calls (``fit`` for ``trainer.fit(...)``, ``notebook_launcher``)."""
    imported: frozenset[str]
    """The packages the notebook's cells import."""
    made_by: str
    """For ``x.method(...)``: the class ``x`` was built from (``Trainer``, ``Trainer(...)`` when built in the call
    itself), where a cell assigned it; else ``""``."""
    shown: str
    """``x.method`` as the user wrote it (``trainer.fit``)."""
    spawners: frozenset[str]
    """The notebook's functions that start ranks with ``mp.spawn`` (the DDP tutorial's ``run_demo``)."""
    built: Mapping[str, str]
    """Each variable the notebook's running code assigned a call to, so far: the called name (``engine`` →
    ``DistributedDataParallelEngine``)."""
    classes: Mapping[str, ast.ClassDef]
    """The classes the notebook's running code defined, so far, by name (a runner whose ``get_engine`` is its own)."""


@dataclass(frozen=True)
class Engine:
    """One engine, every fact about it."""

    name: str
    code: Callable[[CodeRequest], EngineCode]
    """The lines it puts around the cells."""
    packages: tuple[str, ...] = ()
    """The packages that mark a notebook as its (detection needs one imported)."""
    library: bool = False
    """A library's notebook, run unchanged under torchrun, its ``packages`` adapted on each rank."""
    trains_with: Callable[[CellFacts], bool] | None = None
    """Whether the training cells call for it; detection asks the engines in the registry's order."""
    sets_up_with: Callable[[CellFacts], bool] | None = None
    """Whether, no training cell deciding, the cells call for it anyway (an ``Accelerator`` built in a setup
    cell must see the ranks too)."""
    detected_by: str = ""
    """How its notebooks are told apart, for ``--engine``'s help (``runner.train(loaders=...)``)."""
    spawns_its_own_ranks: bool = False
    """Its script starts the ranks itself (Catalyst's ``runner.train``) instead of being started on each."""
    shard_instead: str | None = None
    """Why ``--shard`` doesn't go with it, and what shards there; ``None``: ``nbddp.prepare(model)`` shards."""
    process_count: ProcessCount | None = None
    """The call whose literal process count the run takes, when the cells write one."""
    launch_text: str = ""
    """Its launching call as a message names it (``a Lightning Trainer's .fit(...)``): what nbddp recognises in a
    notebook no cell of which is marked."""
    unlaunched_hint: str = ""
    """Said when its notebook (its :attr:`trains_with` read in any cell) has no call :attr:`launches` takes."""
    launches: Callable[[LaunchCall], str | None] | None = None
    """Whether a call in a notebook no cell of which is marked starts its training: the call as the user wrote it
    (``notebook_launcher``, ``trainer.fit``), else ``None`` (:func:`nbddp.engines.read_launches` asks each
    engine of every call of the cells' running code)."""
