"""Engines: what each adds to the generated script and how its script is launched.

``torch``: plain PyTorch DDP, one process per device started by ``torch.distributed.run``.
``catalyst``: the user's ``runner.train(...)`` runs with Catalyst's ``DistributedDataParallelEngine``,
which spawns the processes itself. ``accelerate``, ``lightning``, ``transformers``: notebooks written
for those libraries run unchanged under torchrun, the library's notebook launcher or fork strategy
replaced by the ranks torchrun started (:mod:`nbddp.engines.frameworks`). Nothing here imports torch
or any of those libraries: this runs in the notebook kernel and the CLI, before any rank exists.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from typing import Protocol, Sequence

from nbddp.contracts.role_names import TRAIN


class ExportedCell(Protocol):
    """What an engine reads of a chosen cell (:class:`nbddp.notebook.roles.ExportedCell` is one): its role and
    code. A protocol, so that the engines sit below the notebook side that asks them."""

    @property
    def role(self) -> str: ...

    @property
    def code(self) -> str: ...

#: Libraries whose notebooks run unchanged under torchrun, each with the packages that mark a notebook as its.
FRAMEWORKS: dict[str, tuple[str, ...]] = {
    "accelerate": ("accelerate",),
    "lightning": ("lightning", "pytorch_lightning"),
    "transformers": ("transformers",),
}
ENGINES = ("torch", "catalyst", *FRAMEWORKS)
#: What a run hands back unless ``--return`` says otherwise: ``model``, where a cell defines one.
DEFAULT_RETURNS = ("model",)
#: Engines whose ranks are not started by torchrun (Catalyst's ``runner.train`` spawns its own).
SPAWN_THEIR_OWN_RANKS = frozenset({"catalyst"})
_SHARD_INSTEAD = {
    "catalyst": "Catalyst 22.4, its last release, has no FSDP2 engine",
    "accelerate": "with Accelerate, shard with its own FSDP plugin (Accelerator(fsdp_plugin=...))",
    "lightning": "with Lightning, shard with its own strategy (Trainer(strategy=\"fsdp\") on GPUs)",
    "transformers": "with the Hugging Face Trainer, shard with its own option (TrainingArguments(fsdp=...))",
}


def shard_refusal(engine: str) -> str:
    """Why ``--shard`` and ``engine`` don't go together (``--shard`` shards ``nbddp.prepare(model)``)."""
    return (f"--shard needs the torch engine: {_SHARD_INSTEAD.get(engine, 'it shards nbddp.prepare(model)')}. "
            "Drop --shard, or train with nbddp.prepare(model) in a plain PyTorch loop (--engine torch).")


def spawns_its_own_ranks(engine: str | None) -> bool:
    """Whether the script starts its ranks itself (Catalyst) rather than being started by torchrun on each."""
    return engine in SPAWN_THEIR_OWN_RANKS


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


def detect_engine(cells: Sequence[ExportedCell]) -> str:
    """The engine the training cells call for, from what the cells import and call.

    ``catalyst``: a runner's ``.train(..., loaders=...)`` in a training cell (Catalyst's ``Runner.train``
    is keyword-only and ``loaders`` is required). ``accelerate``: ``notebook_launcher(...)``,
    ``debug_launcher(...)`` or ``Accelerator(...)`` in a training cell. ``lightning``: a ``Trainer(...)``
    and, in a training cell, its ``.fit(...)``. ``transformers``: a ``...Trainer(...)`` and, in a training
    cell, its ``.train()``. Each also needs its package imported. The training cells decide first (a
    kernel's ``#| ddp`` cells may serve notebooks of several libraries); then an ``Accelerator`` built in
    a setup cell makes it ``accelerate`` (it must see the ranks too); else ``torch``.
    """
    imported = set().union(*(_imported_packages(c.code) for c in cells))
    every = set().union(*(_called_names(c.code) for c in cells))
    trained = set().union(*(_called_names(c.code) for c in cells if c.role == TRAIN))
    accelerate_calls = {"notebook_launcher", "debug_launcher", "Accelerator"}
    if "catalyst" in imported and any(_calls_runner_train(c.code) for c in cells if c.role == TRAIN):
        return "catalyst"
    if "accelerate" in imported and trained & accelerate_calls:
        return "accelerate"
    if imported & set(FRAMEWORKS["lightning"]) and "fit" in trained and "Trainer" in every:
        return "lightning"
    if "transformers" in imported and "train" in trained and any(n.endswith("Trainer") for n in every):
        return "transformers"
    if "accelerate" in imported and every & accelerate_calls:
        return "accelerate"
    return "torch"


#: Accelerate's calls that start a notebook's training (nbddp's ranks run their function in place).
ACCELERATE_LAUNCHERS = ("notebook_launcher", "debug_launcher")


def training_launch(codes: Sequence[str | None]) -> tuple[int, str] | None:
    """Which of a notebook's cells launches a library's training, with no cell marked: the first whose
    running code (not a ``def`` body) calls Accelerate's ``notebook_launcher(...)`` (or ``debug_launcher``),
    a Lightning ``Trainer``'s ``.fit(...)``, a Hugging Face ``...Trainer``'s ``.train()``, or torch's
    ``mp.spawn(...)`` — directly or through a function of the notebook that calls it (the DDP tutorial's
    ``run_demo``) —, the library imported by some cell. ``trainer.fit``/``trainer.train`` count when ``trainer`` was assigned a Trainer
    (in that cell or an earlier one): ``model.train()`` and scikit-learn's ``model.fit(X, y)`` don't.

    ``codes``: the cells' Python in notebook order (``None`` for one that isn't). Returns the index of that
    cell in ``codes`` and the call as the user wrote it (``trainer.fit``, ``notebook_launcher``), or ``None``.
    """
    imported = set().union(*(_imported_packages(c) for c in codes if c is not None))
    lightning = bool(imported & set(FRAMEWORKS["lightning"]))
    trainers: dict[str, str] = {}  # variable → the Trainer class it holds
    spawners: set[str] = set()  # the notebook's functions that start ranks with mp.spawn (the tutorial's run_demo)
    for index, code in enumerate(codes):
        tree = _parse(code) if code is not None else None
        calls = [node for node in _running_nodes(tree) if isinstance(node, ast.Call)] if tree else []
        for node in _running_nodes(tree) if tree else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                trainers.update({t.id: _name_of(node.value.func) for t in node.targets if isinstance(t, ast.Name)})
        if "torch" in imported and tree is not None:
            spawners |= {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and any(_spawns_ranks(sub) for sub in ast.walk(node))}
        for call in calls:
            name = _name_of(call.func)
            if "accelerate" in imported and name in ACCELERATE_LAUNCHERS:
                return index, name
            if "torch" in imported and _spawns_ranks(call):
                return index, f"{ast.unparse(call.func)}"
            if isinstance(call.func, ast.Name) and call.func.id in spawners:
                return index, f"{call.func.id} → mp.spawn"
            if not isinstance(call.func, ast.Attribute) or name not in ("fit", "train"):
                continue
            receiver = call.func.value
            made_by = (trainers.get(receiver.id, "") if isinstance(receiver, ast.Name)
                       else _name_of(receiver.func) + "(...)" if isinstance(receiver, ast.Call) else "")
            shown = f"{receiver.id if isinstance(receiver, ast.Name) else made_by}.{name}"
            if name == "fit" and lightning and made_by.removesuffix("(...)") == "Trainer":
                return index, shown
            if name == "train" and "transformers" in imported and made_by.removesuffix("(...)").endswith("Trainer"):
                return index, shown
    return None


def _running_nodes(tree: ast.AST):  # noqa: ANN202 - yields ast nodes
    """The nodes of ``tree`` that run with it, in source order: not inside a ``def`` or ``lambda`` body."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        yield from _running_nodes(node)


def framework_packages(cells: Sequence[ExportedCell], engine: str) -> tuple[str, ...]:
    """Which of ``engine``'s packages the cells import (``lightning`` and/or ``pytorch_lightning``):
    the ranks adapt only those, so a rank never imports a package the notebook doesn't use."""
    imported = set().union(*(_imported_packages(c.code) for c in cells))
    packages = FRAMEWORKS.get(engine, ())
    return tuple(p for p in packages if p in imported) or packages[:1]


#: For each engine, the calls whose literal process count the run takes: ``(function names, keyword,
#: position of the count among the positional arguments)``. ``mp.spawn(fn, args, nprocs)`` and
#: ``start_processes`` count with any engine that torchrun starts (a library may call them).
_PROCESS_COUNTS = {
    "accelerate": (("notebook_launcher",), "num_processes", 2),  # notebook_launcher(function, args, num_processes)
    "lightning": (("Trainer",), "devices", None),
}
_SPAWN_COUNT = (("spawn", "start_processes"), "nprocs", 2)


def processes_asked(cells: Sequence[ExportedCell], engine: str) -> int | None:
    """The process count the training cells ask their library for, when it is a literal:
    ``notebook_launcher(..., num_processes=N)``, ``Trainer(devices=N)``, or ``mp.spawn(fn, nprocs=N)`` (PyTorch's
    DDP tutorial). It becomes the run's process count unless a launch option (``--gpus``, ``--nproc``) says
    otherwise (:func:`nbddp.contracts.devices.notebook_devices`)."""
    asked = [_PROCESS_COUNTS[engine]] if engine in _PROCESS_COUNTS else []
    if not spawns_its_own_ranks(engine):
        asked.append(_SPAWN_COUNT)
    for names, keyword, position in asked:
        for cell in cells:
            tree = _parse(cell.code)
            for node in ast.walk(tree) if tree else ():
                if not (isinstance(node, ast.Call) and _name_of(node.func) in names):
                    continue
                if names is _SPAWN_COUNT[0] and not _is_torch_spawn(node.func):
                    continue
                values = [k.value for k in node.keywords if k.arg == keyword]
                if position is not None and len(node.args) > position:
                    values.append(node.args[position])
                for value in values:
                    if isinstance(value, ast.Constant) and type(value.value) is int and value.value > 0:
                        return value.value
    return None


def _spawns_ranks(node: ast.AST) -> bool:
    """``mp.spawn(...)`` / ``start_processes(...)`` of torch.multiprocessing: PyTorch's DDP tutorial starting its ranks."""
    return (isinstance(node, ast.Call) and _name_of(node.func) in _SPAWN_COUNT[0] and _is_torch_spawn(node.func))


def _is_torch_spawn(func: ast.expr) -> bool:
    """``mp.spawn``, ``torch.multiprocessing.spawn``, ``multiprocessing.start_processes`` or a bare ``spawn``
    (imported from torch.multiprocessing): not another library's ``spawn`` (``pexpect.spawn``)."""
    if isinstance(func, ast.Name):
        return True
    owner = func.value if isinstance(func, ast.Attribute) else None
    return _name_of(owner) in ("mp", "multiprocessing", "torch_mp", "tmp") if owner is not None else False


def saves_checkpoints(cells: Sequence[ExportedCell]) -> bool:
    """The cells call ``nbddp.save_checkpoint`` on every rank: a Slurm job of them can stop at a save and
    resume (``--requeue``'s default). Not another library's ``save_checkpoint`` (Lightning's, DeepSpeed's),
    nor one under an ``if`` that asks which rank this is (``if nbddp.is_main():``): every rank must reach
    the save where they all stop."""
    trees = [tree for cell in cells if (tree := _parse(cell.code)) is not None]
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


@functools.lru_cache(maxsize=1024)
def _parse(code: str) -> ast.AST | None:
    """A cell's tree, parsed once for every question asked of it here (callers only read it)."""
    try:
        return ast.parse(code)
    except SyntaxError:
        return None


@functools.lru_cache(maxsize=1024)
def _cell_facts(code: str) -> tuple[frozenset[str], frozenset[str]]:
    """The top-level packages ``code`` imports and the names it calls (``f`` for ``f(...)`` and
    ``x.y.f(...)``), from one walk; cached, as detection asks of every cell more than once."""
    tree = _parse(code)
    packages: set[str] = set()
    called: set[str] = set()
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Import):
            packages |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            packages.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Call):
            called.add(_name_of(node.func))
    return frozenset(packages), frozenset(called)


def _imported_packages(code: str) -> frozenset[str]:
    return _cell_facts(code)[0]


def _called_names(code: str) -> frozenset[str]:
    return _cell_facts(code)[1]


def _name_of(func: ast.expr) -> str:
    """``f`` for ``f(...)`` and ``x.f(...)``."""
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _calls_runner_train(code: str) -> bool:
    tree = _parse(code)
    for node in ast.walk(tree) if tree else ():
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "train"
            and any(k.arg == "loaders" for k in node.keywords)
        ):
            return True
    return False
