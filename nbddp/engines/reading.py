"""Reading a cell's code for the engines: its tree, parsed once, and what it imports and calls.

Every question the engines ask of a cell (which engine, which library packages, how many processes,
whether it saves checkpoints, which cell launches the training) reads it through here, so a cell is
parsed once however many are asked (cached by its code).
"""

from __future__ import annotations

import ast
import functools
from typing import Sequence

from nbddp.contracts.cell_tree import tree_or_none
from nbddp.contracts.role_names import TRAIN
from nbddp.engines.engine import CellFacts, CodeCell


def facts(cells: Sequence[CodeCell]) -> CellFacts:
    """What detection reads of ``cells``: the packages they import, the names they call, those the training
    cells call, and the training cells' code."""
    read = [(c.role, c.code, *_cell_facts(c.code)) for c in cells]
    train = [(code, called) for role, code, _, called in read if role == TRAIN]
    return CellFacts(frozenset().union(*(imported for _, _, imported, _ in read)),
                     frozenset().union(*(called for _, _, _, called in read)),
                     frozenset().union(*(called for _, called in train)), tuple(code for code, _ in train))


def parse(code: str) -> ast.AST | None:
    """A cell's tree (:mod:`nbddp.contracts.cell_tree`: parsed once for every reader), ``None`` if it isn't Python."""
    return tree_or_none(code)


@functools.lru_cache(maxsize=1024)
def _cell_facts(code: str) -> tuple[frozenset[str], frozenset[str]]:
    """The top-level packages ``code`` imports and the names it calls (``f`` for ``f(...)`` and
    ``x.y.f(...)``), from one walk; cached, as detection asks of every cell more than once."""
    tree = parse(code)
    packages: set[str] = set()
    called: set[str] = set()
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Import):
            packages |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            packages.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Call):
            called.add(name_of(node.func))
    return frozenset(packages), frozenset(called)


def imported_packages(code: str) -> frozenset[str]:
    return _cell_facts(code)[0]


#: ``mp.spawn(fn, args, nprocs)`` and ``start_processes``: their count counts with any engine torchrun starts
#: (a library may call them).
SPAWN_COUNT = (("spawn", "start_processes"), "nprocs", 2)


def spawns_ranks(node: ast.AST) -> bool:
    """``mp.spawn(...)`` / ``start_processes(...)`` of torch.multiprocessing: PyTorch's DDP tutorial starting its
    ranks."""
    return isinstance(node, ast.Call) and name_of(node.func) in SPAWN_COUNT[0] and is_torch_spawn(node.func)


def is_torch_spawn(func: ast.expr) -> bool:
    """``mp.spawn``, ``torch.multiprocessing.spawn``, ``multiprocessing.start_processes`` or a bare ``spawn``
    (imported from torch.multiprocessing): not another library's ``spawn`` (``pexpect.spawn``)."""
    if isinstance(func, ast.Name):
        return True
    owner = func.value if isinstance(func, ast.Attribute) else None
    return name_of(owner) in ("mp", "multiprocessing", "torch_mp", "tmp") if owner is not None else False


def name_of(func: ast.expr) -> str:
    """``f`` for ``f(...)`` and ``x.f(...)``."""
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
