"""Engines: what each adds to the generated script and how its script is launched.

``torch``: plain PyTorch DDP, one process per device started by ``torch.distributed.run``.
``catalyst``: the user's ``runner.train(...)`` runs with Catalyst's ``DistributedDataParallelEngine``,
which spawns the processes itself. ``accelerate``, ``lightning``, ``transformers``: notebooks written
for those libraries run unchanged under torchrun, the library's notebook launcher or fork strategy
replaced by the ranks torchrun started (:mod:`nbddp.engines.frameworks`).

Each engine is one record (:class:`~nbddp.engines.engine.Engine`) in its own module, registered here by name
(:data:`BUILTIN`); everything below asks the records, down to which call launches an unmarked notebook's training.
As with launchers, another package may register a record under a built-in engine's name through the
``nbddp.engines`` entry point group: it replaces the built-in one (read when a run first asks for an engine; the
``--engine`` help describes the built-in ones). Nothing here imports torch or any of those libraries: this runs in
the notebook kernel and the CLI, before any rank exists.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from importlib import import_module
from typing import Iterator, Sequence

from nbddp.contracts.errors import NbddpError, UsageError
from nbddp.contracts import plugins
from nbddp.contracts.plugins import registered
from nbddp.contracts.role_names import TRAIN
from nbddp.engines.reading import SPAWN_COUNT, facts, imported_packages, is_torch_spawn, name_of, parse, spawns_ranks
from nbddp.engines.engine import CodeCell, CodeRequest, Engine, EngineCode, LaunchCall  # (the engines' face)

#: Every engine, by name: ``module:attribute`` of its record, loaded on first use. Detection asks them in this
#: order (``torch``, which no notebook calls for by name, answers when none of the others does).
BUILTIN = {
    "torch": "nbddp.engines.torch:ENGINE",
    "catalyst": "nbddp.engines.catalyst:ENGINE",
    "accelerate": "nbddp.engines.frameworks:ACCELERATE",
    "lightning": "nbddp.engines.frameworks:LIGHTNING",
    "transformers": "nbddp.engines.frameworks:TRANSFORMERS",
}
ENGINES = tuple(BUILTIN)
ENTRY_POINTS = "nbddp.engines"
#: What a run hands back unless ``--return`` says otherwise: ``model``, where a cell defines one.
DEFAULT_RETURNS = ("model",)
_loaded: dict[str, Engine] = {}


def engine(name: str) -> Engine:
    """The record registered under ``name``: an ``nbddp.engines`` entry point, else the built-in one.

    Raises:
        KeyError: no engine has that name.
    """
    if name not in _loaded:
        _loaded[name] = _record(registered(ENTRY_POINTS).get(name) or BUILTIN[name])
    return _loaded[name]


def register(name: str, target: str) -> None:
    """Replace the built-in engine ``name`` in this process with the record at ``target`` (``module:attribute``), as
    an ``nbddp.engines`` entry point does for every process. (Ranks re-read nothing: the script holds what the record
    wrote.)

    Raises:
        UsageError: ``name`` is no engine's.
    """
    if name not in BUILTIN:
        raise UsageError(f"no engine is named {name!r}: register() replaces one of {', '.join(ENGINES)}.")
    plugins.register(ENTRY_POINTS, name, target)
    _loaded.pop(name, None)


def _record(target: str) -> Engine:
    module, _, attribute = target.partition(":")
    return getattr(import_module(module), attribute)


def engines() -> list[Engine]:
    """Every engine's record, in :data:`BUILTIN`'s order."""
    return [engine(name) for name in BUILTIN]


def engine_help() -> str:
    """``--engine``'s help, from the built-in records (every command builds it: no entry point is read for it):
    how each engine's notebooks are told apart."""
    told = ", ".join(f"{e.name} for {e.detected_by}" for e in map(_record, BUILTIN.values()) if e.detected_by)
    return f"DDP engine (default: from the training cells: {told}, else torch)"


def shard_refusal(name: str) -> str:
    """Why ``--shard`` and engine ``name`` don't go together (``--shard`` shards ``nbddp.prepare(model)``)."""
    instead = engine(name).shard_instead if name in BUILTIN else None
    return (f"--shard needs the torch engine: {instead or 'it shards nbddp.prepare(model)'}. "
            "Drop --shard, or train with nbddp.prepare(model) in a plain PyTorch loop (--engine torch).")


def shards(name: str) -> bool:
    """Whether ``--shard`` goes with engine ``name`` (its ``nbddp.prepare(model)`` shards)."""
    return name in BUILTIN and engine(name).shard_instead is None


def spawns_its_own_ranks(name: str | None) -> bool:
    """Whether the script starts its ranks itself (Catalyst) rather than being started by torchrun on each."""
    return name in BUILTIN and engine(name).spawns_its_own_ranks


@dataclass(frozen=True)
class EnginePlan:
    """What the engine makes of a script's cells, read once (:func:`plan_engine`): which engine, the lines it puts
    around them, and the facts about the run its cells state."""

    engine: str
    code: EngineCode
    returns: tuple[str, ...]
    """The variables rank 0 saves for the kernel; ``()`` when no cell defines the default ``model``."""
    returns_note: str
    """Why nothing comes back, when :attr:`returns` is empty."""
    processes: int | None
    """The process count the cells ask their library for (:func:`processes_asked`)."""
    saves_checkpoints: bool


def plan_engine(cells: Sequence[CodeCell], name: str | None, returns: tuple[str, ...], script_name: str,
                shard: bool = False) -> EnginePlan:
    """Engine ``name`` (``None``: the one the cells call for, :func:`detect_engine`) with ``cells``: its code (the
    packages of its library the cells import, what comes back) and what the cells ask of the run.

    Raises:
        NbddpError: no engine has that name. UsageError: ``shard`` with an engine that doesn't shard.
    """
    name = name or detect_engine(cells)
    if name not in BUILTIN:
        raise NbddpError(f"unknown engine {name!r}; choose one of: {', '.join(ENGINES)}.")
    if shard and not shards(name):
        raise UsageError(shard_refusal(name))
    record, packages = engine(name), framework_packages(cells, name)
    processes, saves = processes_asked(cells, name), saves_checkpoints(cells)
    returns, returns_note = returned(cells, returns, name)
    code = record.code(CodeRequest(tuple(returns), script_name, shard, packages))
    return EnginePlan(name, code, returns, returns_note, processes, saves)


def returned(cells: Sequence[CodeCell], returns: tuple[str, ...], name: str) -> tuple[tuple[str, ...], str]:
    """The variables the script hands back, and why none when none: the default ``model`` where no cell defines
    one at module level (PyTorch's DDP tutorial builds its model inside the function ``mp.spawn`` runs, and
    saves it there) comes back as nothing, said, rather than as a NameError after a finished training.
    Asked for by name (``--return``), a missing variable stays an error."""
    if returns != DEFAULT_RETURNS or spawns_its_own_ranks(name):
        return returns, ""
    from nbddp.contracts.freevars import cell_names

    defined: set[str] = set()
    for cell in cells:
        try:
            names = cell_names(cell.code)
        except SyntaxError:
            return returns, ""
        if names.star_import:
            return returns, ""
        defined |= names.defines
    if set(returns) <= defined:
        return returns, ""
    missing = ", ".join(name for name in returns if name not in defined)
    return (), f"nothing to return: no cell defines {missing} (the training function keeps its own)"


def detect_engine(cells: Sequence[CodeCell]) -> str:
    """The engine the training cells call for, from what the cells import and call.

    Each engine's record says what calls for it (:attr:`~nbddp.engines.engine.Engine.trains_with`), asked in
    :data:`BUILTIN`'s order: ``catalyst``, a runner's ``.train(..., loaders=...)`` in a training cell;
    ``accelerate``, ``notebook_launcher(...)``, ``debug_launcher(...)`` or ``Accelerator(...)`` in a training cell;
    ``lightning``, a ``Trainer(...)`` and, in a training cell, its ``.fit(...)``; ``transformers``, a
    ``...Trainer(...)`` and, in a training cell, its ``.train()`` (each also needs its package imported). The
    training cells decide first (a kernel's ``#| ddp`` cells may serve notebooks of several libraries); then what
    a setup cell calls for (:attr:`~nbddp.engines.engine.Engine.sets_up_with`: an ``Accelerator`` built in a setup
    cell must see the ranks too); else ``torch``.
    """
    read = facts(cells)
    for rule in ("trains_with", "sets_up_with"):
        for candidate in engines():
            if (asks := getattr(candidate, rule)) is not None and asks(read):
                return candidate.name
    return "torch"


@dataclass(frozen=True)
class Launches:
    """What the engines read of an unmarked notebook's launches (:func:`read_launches`)."""

    found: list[tuple[int, str]]
    """``(index in codes, the call as written)`` of each cell that launches a training, in order."""
    hints: list[str]
    """What to add to "no training cell" where none does (:attr:`~nbddp.engines.engine.Engine.unlaunched_hint`)."""


def read_launches(codes: Sequence[str | None]) -> Launches:
    """The cells of a notebook with no cell marked whose running code (not a ``def`` body) makes a call some
    engine's record says starts its training (:attr:`~nbddp.engines.engine.Engine.launches`), each with the first
    such call as the user wrote it: Accelerate's ``notebook_launcher(...)`` (or ``debug_launcher``), a Lightning
    ``Trainer``'s ``.fit(...)``, a Hugging Face ``...Trainer``'s ``.train()``, a Catalyst runner's ``.train(...)``
    that asks for DDP (``ddp=True``, a ``DistributedDataParallelEngine``, or a runner whose ``get_engine`` returns
    one), or torch's ``mp.spawn(...)`` — directly or through a function of the notebook that calls it (the DDP
    tutorial's ``run_demo``) —, the library imported by some cell. ``trainer.fit``/``trainer.train`` count when
    ``trainer`` was assigned a Trainer (in that cell or an earlier one): ``model.train()`` and scikit-learn's
    ``model.fit(X, y)`` don't.

    ``codes``: the cells' Python in notebook order (``None`` for one that isn't). Returns ``(index in codes, call)``
    for each such cell, in order, and, for a notebook some engine recognises though none of its calls launches,
    what that engine says to do (:func:`unlaunched_hints`).
    """
    imported = frozenset().union(*(imported_packages(c) for c in codes if c is not None))
    asked = [e.launches for e in engines() if e.launches is not None]
    built: dict[str, str] = {}  # variable → what was called to make it
    classes: dict[str, ast.ClassDef] = {}
    spawners: set[str] = set()  # the notebook's functions that start ranks with mp.spawn (the tutorial's run_demo)
    found: list[tuple[int, str]] = []
    for index, code in enumerate(codes):
        tree = parse(code) if code is not None else None
        running = list(_running_nodes(tree)) if tree else []
        for node in running:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                built.update({t.id: name_of(node.value.func) for t in node.targets if isinstance(t, ast.Name)})
            elif isinstance(node, ast.ClassDef):
                classes[node.name] = node
        if "torch" in imported and tree is not None:
            spawners |= {node.name for node in ast.walk(tree)
                         if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and any(spawns_ranks(sub) for sub in ast.walk(node))}
        for call in (node for node in running if isinstance(node, ast.Call)):
            seen = LaunchCall(call, name_of(call.func), imported, *_receiver(call, built), frozenset(spawners),
                              dict(built), dict(classes))
            launch = next(filter(None, (launches(seen) for launches in asked)), None)
            if launch is not None:
                found.append((index, launch))
                break
    return Launches(found, [] if found else unlaunched_hints(codes))


def unlaunched_hints(codes: Sequence[str | None]) -> list[str]:
    """What to add to "no training cell" for a notebook some engine recognises (read as if every cell trained) though
    no call of it launches the training (:attr:`~nbddp.engines.engine.Engine.unlaunched_hint`)."""
    read = facts([_AsTraining(code) for code in codes if code is not None])
    return [e.unlaunched_hint for e in engines()
            if e.unlaunched_hint and e.trains_with is not None and e.trains_with(read)]


class _AsTraining:
    """A cell's code read as a training cell's (a :class:`~nbddp.engines.engine.CodeCell`)."""

    role = TRAIN

    def __init__(self, code: str) -> None:
        self.code = code


def launch_texts() -> list[str]:
    """Every engine's launching call as a message names it (:attr:`~nbddp.engines.engine.Engine.launch_text`)."""
    return [e.launch_text for e in engines() if e.launch_text]


def _receiver(call: ast.Call, built: dict[str, str]) -> tuple[str, str]:
    """For ``x.method(...)``: what ``x`` was built from (``Trainer``; ``Trainer(...)`` when built in the call), and
    ``x.method`` as written; ``("", "")`` for a plain call."""
    receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
    made_by = (built.get(receiver.id, "") if isinstance(receiver, ast.Name)
               else name_of(receiver.func) + "(...)" if isinstance(receiver, ast.Call) else "")
    shown = f"{receiver.id if isinstance(receiver, ast.Name) else made_by}.{name_of(call.func)}" if receiver else ""
    return made_by, shown


def _running_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``tree`` that run with it, in source order: not inside a ``def`` or ``lambda`` body."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        yield from _running_nodes(node)


def framework_packages(cells: Sequence[CodeCell], name: str) -> tuple[str, ...]:
    """Which of library ``name``'s packages the cells import (``lightning`` and/or ``pytorch_lightning``):
    the ranks adapt only those, so a rank never imports a package the notebook doesn't use."""
    imported = set().union(*(imported_packages(c.code) for c in cells))
    packages = engine(name).packages if name in BUILTIN and engine(name).library else ()
    return tuple(p for p in packages if p in imported) or packages[:1]


def processes_asked(cells: Sequence[CodeCell], name: str) -> int | None:
    """The process count the training cells ask their library for, when it is a literal:
    ``notebook_launcher(..., num_processes=N)``, ``Trainer(devices=N)``, or ``mp.spawn(fn, nprocs=N)`` (PyTorch's
    DDP tutorial). It becomes the run's process count unless a launch option (``--gpus``, ``--nproc``) says
    otherwise (:func:`nbddp.contracts.devices.notebook_devices`)."""
    counted = engine(name).process_count if name in BUILTIN else None
    asked = [counted] if counted else []
    if not spawns_its_own_ranks(name):
        asked.append(SPAWN_COUNT)
    for names, keyword, position in asked:
        for cell in cells:
            tree = parse(cell.code)
            for node in ast.walk(tree) if tree else ():
                if not (isinstance(node, ast.Call) and name_of(node.func) in names):
                    continue
                if names is SPAWN_COUNT[0] and not is_torch_spawn(node.func):
                    continue
                values = [k.value for k in node.keywords if k.arg == keyword]
                if position is not None and len(node.args) > position:
                    values.append(node.args[position])
                for value in values:
                    if isinstance(value, ast.Constant) and type(value.value) is int and value.value > 0:
                        return value.value
    return None


def saves_checkpoints(cells: Sequence[CodeCell]) -> bool:
    """The cells call ``nbddp.save_checkpoint`` on every rank: a Slurm job of them can stop at a save and
    resume (``--requeue``'s default). Not another library's ``save_checkpoint`` (Lightning's, DeepSpeed's),
    nor one under an ``if`` that asks which rank this is (``if nbddp.is_main():``): every rank must reach
    the save where they all stop."""
    trees = [tree for cell in cells if (tree := parse(cell.code)) is not None]
    modules, functions = {"nbddp"}, set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {a.asname or a.name for a in node.names if a.name == "nbddp"}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "nbddp":
                functions |= {a.asname or a.name for a in node.names if a.name == "save_checkpoint"}

    def saves(node: ast.AST) -> bool:
        if isinstance(node, ast.If) and any(word in ast.unparse(node.test) for word in ("rank", "is_main")):
            return False  # one rank's save: not where every rank can stop
        if isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "save_checkpoint"
                 and isinstance(node.func.value, ast.Name) and node.func.value.id in modules)
                or (isinstance(node.func, ast.Name) and node.func.id in functions)):
            return True
        return any(saves(child) for child in ast.iter_child_nodes(node))

    return any(saves(tree) for tree in trees)
