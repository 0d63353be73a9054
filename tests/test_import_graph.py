"""Imports flow one way: door → job → doctor → launchers → plan → notebook → engines → rank side → contracts
(docs/architecture.md), and each layer is a folder.

Every module of the package is parsed (not imported) and placed in a layer by :data:`LAYERS`, whose patterns
are folders (a top-level module only where it is a door, or the rank's API); a module may import its own
layer and the layers below it, never one above, and no two modules may import each other, however
indirectly. Imports inside functions count (a lazy import is still an import: it only runs later), and so do
those under ``if TYPE_CHECKING:`` (a type names what the module depends on). Importing ``a.b.c`` also runs
``a/__init__.py`` and ``a/b/__init__.py``: what those import at their top (``engines``' and ``launchers``' do)
is imported too.

Why this order: the job chains the stages and starts launchers; the doctor examines the machine for a run as asked
(its devices by the launchers' rule), and the job asks it to explain a failure; a launcher reads the plan (the launch
options, the job's spec) and starts the ranks with their environment (``RankEnv``); the plan reads the
notebook side (the script) and the engines (what each needs); the engines say what a library adds, from a
cell's role and code alone; a rank reads only its environment and the contracts, so an exported script needs
nothing of the plan; the contracts (what crosses a process boundary — the run dir's and the pool's files,
the rank's environment, statuses, metrics, checkpoints, the source map — and the leaves every layer reads:
errors, atomic files, devices) import nothing above them. ``display`` shows what the job produced, so it
sits above the job, and the doors above all.
"""

from __future__ import annotations

import ast
import fnmatch
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import nbddp

PACKAGE = Path(nbddp.__file__).parent

#: Lowest first. A module belongs to the first layer with a pattern that matches its name.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("contracts", ("nbddp._version", "nbddp.contracts", "nbddp.contracts.*")),
    ("rank side", ("nbddp.rank_side", "nbddp.rank_side.*", "nbddp.runtime", "nbddp.runtime_catalyst")),
    ("engines", ("nbddp.engines", "nbddp.engines.*")),
    ("notebook", ("nbddp.notebook", "nbddp.notebook.*")),
    ("plan", ("nbddp.plan", "nbddp.plan.*")),
    ("launchers", ("nbddp.launchers", "nbddp.launchers.*")),
    ("doctor", ("nbddp.doctor", "nbddp.doctor.*")),
    ("job", ("nbddp.job", "nbddp.job.*")),
    ("display", ("nbddp.display", "nbddp.display.*")),
    ("doors", ("nbddp", "nbddp.__main__", "nbddp.api", "nbddp.errors", "nbddp.doors", "nbddp.doors.*")),
)

#: Cycles left to another change, each with why; a cycle that is gone must leave this list.
LEFT: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    kind: str
    """``module`` (runs when the importer is imported), ``function`` (inside a function: runs when it is
    called), ``type`` (under ``if TYPE_CHECKING:``) or ``package`` (what the ``__init__`` of a package runs
    when the importer imports one of that package's modules)."""


def modules() -> dict[str, Path]:
    """Every module of the package, by its dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def _target(name: str) -> str | None:
    """The package's module that ``import name`` loads (``name`` may be an attribute of one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _explicit(module: str, path: Path) -> list[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == "module":
                inner = "function"
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "type"
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in child.names]
            for name in names:
                target = _target(name) if name.split(".")[0] == "nbddp" else None
                if target is not None and target != module:
                    found.append(Import(module, target, child.lineno, inner))
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), "module")
    return found


def imports() -> list[Import]:
    """Every import of one of the package's modules by another, with what the packages it goes through run."""
    explicit = [found for module, path in MODULES.items() for found in _explicit(module, path)]
    at_top: dict[str, set[str]] = defaultdict(set)
    for found in explicit:
        if found.kind == "module":
            at_top[found.importer].add(found.imported)
    implicit = []
    for found in explicit:  # importing a.b.c runs a/__init__.py and a/b/__init__.py: what they import at their top
        parent = found.imported.rpartition(".")[0]
        while parent:
            if found.importer != parent and not found.importer.startswith(parent + "."):
                implicit += [Import(found.importer, runs, found.line, "package")
                             for runs in sorted(at_top[parent]) if runs != found.importer]
            parent = parent.rpartition(".")[0]
    seen: dict[tuple[str, str, str], Import] = {}
    for found in explicit + implicit:  # (one per importer, module and kind: the first line)
        seen.setdefault((found.importer, found.imported, found.kind), found)
    return list(seen.values())


IMPORTS = imports()


def layer(module: str) -> int:
    for number, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
            return number
    raise LookupError(f"{module} has no layer: give it one in LAYERS (and in docs/architecture.md)")


def upward() -> list[Import]:
    """The imports of a module above the importer's layer."""
    return [found for found in IMPORTS if layer(found.imported) > layer(found.importer)]


def cycles() -> list[list[str]]:
    """The groups of modules that import each other, directly or not (Tarjan's strongly connected
    components of the explicit imports, of every kind)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for found in IMPORTS:
        if found.kind != "package":
            graph[found.importer].add(found.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(MODULES):
        if module not in index:
            connect(module)
    return groups


def _shown(found: list[Import]) -> list[str]:
    return [f"{f.importer} ({LAYERS[layer(f.importer)][0]}) imports {f.imported} ({LAYERS[layer(f.imported)][0]}), "
            f"line {f.line} [{f.kind}]" for f in found]


def test_every_module_has_a_layer():
    assert [module for module in MODULES if not any(
        fnmatch.fnmatchcase(module, p) for _, patterns in LAYERS for p in patterns)] == []


def test_no_module_imports_a_layer_above_its_own():
    assert _shown(upward()) == []


def test_no_modules_import_each_other():
    found = {frozenset(group) for group in cycles()}
    assert [sorted(group) for group in found - set(LEFT)] == []
    assert [sorted(group) for group in set(LEFT) - found] == []  # (gone: take it off LEFT)


def test_the_graph_is_read_whole():
    """The parse sees what it must: lazy imports, type-only imports, relative ones, packages run."""
    kinds = {(f.importer, f.imported): f.kind for f in IMPORTS}
    assert kinds[("nbddp", "nbddp.api")] == "function"  # (nbddp.run() loads the door on first use)
    assert kinds[("nbddp.runtime", "nbddp.rank_side.torch_engine")] == "module"
    assert any(f.kind == "type" for f in IMPORTS) and any(f.kind == "package" for f in IMPORTS)
    assert len(MODULES) > 80 and all(f.imported in MODULES for f in IMPORTS)


def test_the_leaves_import_only_leaves():
    leaves = [m for m in MODULES if layer(m) == 0]
    assert {"nbddp.contracts.errors", "nbddp.contracts.atomic", "nbddp.contracts.status", "nbddp.contracts.rundir"} <= set(leaves)
    assert [f"{f.importer} imports {f.imported}" for f in IMPORTS if f.importer in leaves and layer(f.imported)] == []


#: What a door (``nbddp.doors.*``) may import: the orchestrator and what it returns (``job``), the plan, the display,
#: the launchers' one face (``nbddp.launchers`` itself: warm pools, a batch's slots, an export's launch by hand), the
#: doctor's checks, the notebook it reads, the shared leaves, and the other doors. Never a launcher's, an engine's or
#: a rank's internals.
DOOR_REACH = ("nbddp.job", "nbddp.job.*", "nbddp.plan", "nbddp.plan.*", "nbddp.display", "nbddp.display.*",
              "nbddp.doctor", "nbddp.doctor.*",
              "nbddp.launchers", "nbddp.notebook", "nbddp.notebook.*", "nbddp.contracts", "nbddp.contracts.*",
              "nbddp.doors", "nbddp.doors.*", "nbddp._version")


def test_doors_reach_only_the_orchestrator_the_plan_and_the_launchers_face():
    doors = [m for m in MODULES if m == "nbddp.doors" or m.startswith("nbddp.doors.")]
    beyond = [f for f in IMPORTS if f.importer in doors and f.kind != "package"
              and not any(fnmatch.fnmatchcase(f.imported, pattern) for pattern in DOOR_REACH)]
    assert _shown(beyond) == []
