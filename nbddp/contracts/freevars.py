"""Names a script uses but never defines, found with Python's own ``symtable``.

The ``%%ddp_train`` magic takes such names from the kernel when they hold
plain data (papermill's injected parameters, values computed in untagged
cells); anything else must be defined in a ``#| ddp`` cell, or the ranks
would fail with a NameError after a long start-up.
"""

from __future__ import annotations

import builtins
import symtable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from nbddp.contracts.cell_tree import tree as parsed

if TYPE_CHECKING:
    import ast

_ALWAYS_DEFINED = {"__name__", "__file__", "__doc__", "__builtins__", "__spec__", "__loader__",
                   "__package__", "__annotations__"}


def free_names(code: str, filename: str = "<script>") -> list[str]:
    """Global names read somewhere in ``code`` but bound nowhere at module level, in order seen.

    Returns ``[]`` when the code star-imports (its names can't be known statically).
    """
    bound, used, star_import = _global_names(code, filename)
    if star_import:
        return []
    return [n for n in used if n not in bound and not _always_there(n)]


def _global_names(code: str, filename: str) -> tuple[set[str], list[str], bool]:
    """The names ``code`` binds at module level, the global names it reads (in order seen, also
    inside functions and classes), and whether it star-imports."""
    top = symtable.symtable(code, filename, "exec")
    comprehensions_own, walrus_bound = _comprehensions_own(parsed(code))
    bound: set[str] = set(walrus_bound)
    used: list[str] = []
    star_import = False

    def visit(table: symtable.SymbolTable, is_top: bool) -> None:
        nonlocal star_import
        for symbol in table.get_symbols():
            name = symbol.get_name()
            if name == "*":
                star_import = True
            if is_top and name in comprehensions_own:
                continue  # (Python 3.12+ lists a module-level comprehension's own names with the module's)
            if is_top:
                if symbol.is_assigned() or symbol.is_imported() or _defines(table, name):
                    bound.add(name)
                if symbol.is_referenced() and name not in used:
                    used.append(name)
            else:
                if symbol.is_global() and symbol.is_referenced() and name not in used:
                    used.append(name)
                if symbol.is_declared_global() and symbol.is_assigned():
                    bound.add(name)
        for child in table.get_children():
            visit(child, False)

    visit(top, True)
    return bound, used, star_import or _star_imports(code)


def _comprehensions_own(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names that only module-level comprehensions bind (their ``for`` targets) and read; and the names their
    walrus targets bind in the module (``[w := f(t) for t in q]`` binds ``w``).

    They are the comprehension's own in every Python 3, but since Python 3.12 (PEP 709 inlines
    comprehensions) ``symtable`` lists them among the module's names, assigned and referenced: ``i`` of
    ``[i for i in range(3)]`` would read as a name the cell defines and needs. A name also read or bound
    outside such a comprehension (``[x for x in x]``'s first ``x``, a walrus target) is the module's.
    """
    import ast

    comprehensions = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
    targets: set[str] = set()
    modules: set[str] = set()
    walrus: set[str] = set()

    def visit(node: ast.AST, own: frozenset[str]) -> None:
        if isinstance(node, scopes):  # their bodies are scopes of their own; what runs at definition isn't
            for part in (*getattr(node, "decorator_list", ()), *getattr(node, "bases", ()),
                         *getattr(node, "keywords", ()), *(getattr(node, "args", None) and
                                                           [*node.args.defaults, *node.args.kw_defaults] or ())):
                if part is not None:
                    visit(part, own)
            return
        if isinstance(node, ast.NamedExpr):  # a walrus binds in the enclosing (here: the module's) scope
            modules.add(node.target.id)
            walrus.add(node.target.id)
            visit(node.value, own)
            return
        if isinstance(node, comprehensions):
            inner = own
            for number, generator in enumerate(node.generators):
                visit(generator.iter, own if number == 0 else inner)  # the first iterable runs outside
                names = {n.id for n in ast.walk(generator.target) if isinstance(n, ast.Name)}
                targets.update(names)
                inner = inner | names
                for condition in generator.ifs:
                    visit(condition, inner)
            for element in (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,):
                visit(element, inner)
            return
        if isinstance(node, ast.Name) and node.id not in own:
            modules.add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child, own)

    visit(tree, frozenset())
    return targets - modules, walrus


def _always_there(name: str) -> bool:
    return name in _ALWAYS_DEFINED or hasattr(builtins, name)


def _star_imports(code: str) -> bool:
    """``from m import *`` anywhere (symtable doesn't list ``*`` as a symbol)."""
    import ast

    return any(isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)
               for node in ast.walk(parsed(code)))


def _defines(table: symtable.SymbolTable, name: str) -> bool:
    """``def f`` / ``class C`` at module level bind their names (a child table of that name)."""
    return any(child.get_name() == name and child.get_type() in ("function", "class") for child in table.get_children())


def executed_reads(code: str) -> dict[str, int]:
    """Global names read by code that runs when the script runs (not only inside function bodies),
    with the line of the first such read. Class bodies and comprehensions run; ``def`` and ``lambda``
    bodies only when called."""
    import ast

    reads: dict[str, int] = {}

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for default in [*node.args.defaults, *node.args.kw_defaults, *getattr(node, "decorator_list", [])]:
                if default is not None:
                    visit(default)  # evaluated at definition time
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            reads[node.id] = min(reads.get(node.id, node.lineno), node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(parsed(code))
    return reads


#: Names a notebook kernel provides that a script doesn't have.
KERNEL_ONLY = ("display", "get_ipython", "In", "Out")
#: Calls that seed a random generator (``torch.manual_seed``, ``np.random.seed``, ``L.seed_everything``,
#: ``transformers.set_seed``): what a cell draws afterwards depends on them.
_SEEDING = frozenset({"manual_seed", "manual_seed_all", "seed", "set_seed", "seed_everything"})
#: Methods a cell calls on an object to look at it (``df.head()``, ``model.parameters()``), not to change it.
_LOOKING = frozenset(
    "head tail describe info sample summary show plot hist boxplot imshow numel size dim item tolist numpy "
    "keys values items count index get parameters named_parameters modules named_modules children "
    "state_dict value_counts nunique unique isna isnull corr mean sum std min max var median "
    "num_parameters print_trainable_parameters to_string to_dict".split())
#: Functions that change their argument in place without a trailing ``_`` (torch's convention).
_CHANGING_FUNCTIONS = frozenset({"shuffle", "setattr", "delattr"})


@dataclass(frozen=True)
class CellNames:
    """What one cell means to the cells around it: what nbddp needs to choose an unmarked notebook's
    setup (:mod:`nbddp.notebook.unmarked`). Static, so it errs on the side of "needed"."""

    defines: frozenset[str]
    """Names the cell binds at module level, in any branch."""
    surely_defines: frozenset[str]
    """Those bound by a statement that always runs (not under ``if``/``for``/``while``/``try``)."""
    needs: tuple[str, ...]
    """Names it reads that an earlier cell must define: read and never bound here, or read before
    (or on the line where) the cell binds them (``model = model.to(device)``)."""
    changes: frozenset[str]
    """Names whose objects its running code may change in place: ``model.apply(init)``,
    ``cfg["lr"] = 0.1``, ``nn.init.zeros_(model.bias)``."""
    seeds: bool
    """It seeds a random generator, which changes what later cells draw."""
    imports: frozenset[str]
    """Names it binds by ``import`` (modules: calling ``torch.tensor(…)`` changes nothing)."""
    star_import: bool
    """``from m import *``: it may define any name."""
    kernel_only: tuple[str, ...]
    """Names only a notebook kernel has (``display``) that its running code reads."""


def cell_names(code: str) -> CellNames:
    """The names ``code`` (one cell's Python) defines, needs from earlier cells, and changes."""
    import ast

    tree = parsed(code)
    bound, used, star_import = _global_names(code, "<cell>")
    first_bind = _first_binds(tree)
    first_read: dict[str, int] = {}  # at module level: a function body reads when called, after the cell binds
    for node in _module_scope(tree):
        read = (node.id if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
                else node.target.id if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name)
                else None)  # (`x += 1` reads x first)
        if read is not None:
            first_read[read] = min(first_read.get(read, node.lineno), node.lineno)
            used.extend([read] if read not in used else [])
    needs = tuple(name for name in used if not _always_there(name) and (
        name not in bound or first_read.get(name, float("inf")) <= first_bind.get(name, float("inf"))))
    changes, seeds = _changes(tree)
    reads = executed_reads(code)
    imports = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
               if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    return CellNames(frozenset(bound), frozenset(_sure_binds(tree.body)), needs, frozenset(changes), seeds,
                     frozenset(imports), star_import, tuple(n for n in KERNEL_ONLY if n in reads and n not in bound))


def _module_scope(tree: ast.Module) -> Iterator[ast.AST]:
    """The nodes of ``tree`` in its module scope: not inside a function, class, lambda or comprehension
    (whose names are their own), though the ``def``/``class`` statements themselves are."""
    import ast

    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp,
              ast.DictComp, ast.GeneratorExp)
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, scopes):
            pending.extend(ast.iter_child_nodes(node))


def _first_binds(tree: ast.Module) -> dict[str, int]:
    """Each name's first binding at module level."""
    import ast

    first: dict[str, int] = {}
    for node in _module_scope(tree):
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [(alias.asname or alias.name).split(".")[0] for alias in node.names]
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names = [node.id]
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names = [node.name]
        for name in names:
            first[name] = min(first.get(name, node.lineno), node.lineno)
    return first


def _sure_binds(body: list[ast.stmt]) -> set[str]:
    """Names bound by statements that always run: assignments, imports, ``def``/``class``, ``with``."""
    import ast

    names: set[str] = set()
    for statement in body:
        if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            if isinstance(statement, ast.AnnAssign) and statement.value is None:
                continue
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                          and not _inside_attribute_or_subscript(target, n)}
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in statement.names}
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, (ast.With, ast.AsyncWith)):
            for item in statement.items:
                if isinstance(item.optional_vars, ast.Name):
                    names.add(item.optional_vars.id)
            names |= _sure_binds(statement.body)
    return names


def _inside_attribute_or_subscript(target: ast.expr, name: ast.Name) -> bool:
    """``a[i] = …`` stores into ``a``'s object: ``i`` (a Load) aside, no name is bound."""
    import ast

    return any(isinstance(node, (ast.Attribute, ast.Subscript)) and name in ast.walk(node) for node in ast.walk(target))


def _changes(tree: ast.Module) -> tuple[set[str], bool]:
    """Names whose objects the cell's running code may change in place, and whether it seeds a generator.

    A method called for its effect alone (``model.apply(init)``, ``data.append(x)``, not ``df.head()``), one
    named the in-place way (``x.clamp_(0, 1)``, ``nn.init.zeros_(model.bias)``) or given ``inplace=True``,
    and a store into an attribute or item (``model.fc = …``, ``cfg["lr"] = …``) change their object;
    ``X[0].reshape(8, 8)`` (a value used) does not."""
    import ast

    changed: set[str] = set()
    seeds = False

    def visit(node: ast.AST) -> None:
        nonlocal seeds
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return  # runs only when called
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, (ast.Attribute, ast.Subscript)) and (root := _root_name(part)):
                    changed.add(root)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Attribute) and func.attr not in _LOOKING and (root := _root_name(func.value)):
                changed.add(root)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            seeds = seeds or name in _SEEDING
            in_place = (name.endswith("_") and not name.startswith("_")) or any(
                k.arg == "inplace" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords)
            if in_place and isinstance(func, ast.Attribute) and (root := _root_name(func.value)):
                changed.add(root)
            if in_place or name in _CHANGING_FUNCTIONS:
                changed.update(root for arg in node.args[:1] if (root := _root_name(arg)))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return changed, seeds


def _root_name(node: ast.expr) -> str | None:
    """``model`` for ``model``, ``model.fc.weight`` and ``data["x"][0]``; ``None`` through a call (``f(x).y``)."""
    import ast

    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def check_defined(script) -> None:  # noqa: ANN001 - an nbddp.notebook.script.Script: a layer above, not imported
    """Refuse a script whose running code reads a name no exported cell, parameter or import defines.

    In a rank that is a ``NameError`` after a long start-up; here it is an error before anything
    starts, naming the cell and line of the first use. Names read only inside functions pass:
    a helper the ranks never call may use what only the kernel has.

    Raises:
        CellError: naming the first such name and where it is used.
    """
    from nbddp.contracts.errors import CellError

    _check_returns(script)
    reads = executed_reads(script.text)
    missing = [name for name in free_names(script.text) if name in reads]
    if not missing:
        return
    where = script.source_map.where(reads[missing[0]]) or script.source_map.notebook
    others = f" (also: {', '.join(missing[1:])})" if len(missing) > 1 else ""
    chosen = getattr(script, "note", None)
    raise CellError(
        f"{where}: the training code uses {missing[0]!r}{others}, which no exported cell or parameter defines, so "
        "every rank would fail with a NameError. Define it in a '#| ddp' cell (or the parameters cell): cells "
        "without a tag run only in the kernel, never in the ranks."
        + (" (No cell is marked, so nbddp chose them: a mark turns that off; mark the training cell "
           "'#| ddp-train' and its setup '#| ddp' too.)" if chosen else ""))


def _check_returns(script) -> None:  # noqa: ANN001 - an nbddp.notebook.script.Script: a layer above, not imported
    """Refuse a ``--return`` name the script never binds at its top level: rank 0 would find nothing to save once
    the whole training had run."""
    from nbddp.contracts.errors import UsageError

    bound, _, star_import = _global_names(script.text, "<script>")
    missing = [name for name in script.returns if name not in bound]
    if not missing or star_import:
        return
    plural = "s" * (len(missing) > 1)
    raise UsageError(f"--return {', '.join(missing)}: no exported cell defines {' or '.join(map(repr, missing))} at "
                     f"its top level, so there would be nothing to return after the training. Return variable{plural} "
                     "a '#| ddp' or '#| ddp-train' cell assigns (not inside a function), or leave --return out (the "
                     "default returns model).")


def global_reads(code: str) -> list[str]:
    """Every global name ``code`` reads, also inside its functions and classes, in order seen (a name it binds
    too: ``lr = lr * 2``)."""
    return _global_names(code, "<cell>")[1]
