"""Names a script uses but never defines, found with Python's own ``symtable``.

The ``%%ddp_train`` magic takes such names from the kernel when they hold
plain data (papermill's injected parameters, values computed in untagged
cells); anything else must be defined in a ``#| ddp`` cell, or the ranks
would fail with a NameError after a long start-up.
"""

from __future__ import annotations

import builtins
import symtable

_ALWAYS_DEFINED = {"__name__", "__file__", "__doc__", "__builtins__", "__spec__", "__loader__",
                   "__package__", "__annotations__"}


def free_names(code: str, filename: str = "<script>") -> list[str]:
    """Global names read somewhere in ``code`` but bound nowhere at module level, in order seen.

    Returns ``[]`` when the code star-imports (its names can't be known statically).
    """
    top = symtable.symtable(code, filename, "exec")
    bound: set[str] = set()
    used: list[str] = []
    star_import = False

    def visit(table: symtable.SymbolTable, is_top: bool) -> None:
        nonlocal star_import
        for symbol in table.get_symbols():
            name = symbol.get_name()
            if name == "*":
                star_import = True
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
    if star_import or _star_imports(code):
        return []
    return [n for n in used if n not in bound and n not in _ALWAYS_DEFINED and not hasattr(builtins, n)]


def _star_imports(code: str) -> bool:
    """``from m import *`` anywhere (symtable doesn't list ``*`` as a symbol)."""
    import ast

    return any(isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)
               for node in ast.walk(ast.parse(code)))


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

    visit(ast.parse(code))
    return reads


def check_defined(script) -> None:  # noqa: ANN001 - nbddp.notebook.script.Script (no import cycle)
    """Refuse a script whose running code reads a name no exported cell, parameter or import defines.

    In a rank that is a ``NameError`` after a long start-up; here it is an error before anything
    starts, naming the cell and line of the first use. Names read only inside functions pass:
    a helper the ranks never call may use what only the kernel has.

    Raises:
        CellError: naming the first such name and where it is used.
    """
    from nbddp.errors import CellError

    reads = executed_reads(script.text)
    missing = [name for name in free_names(script.text) if name in reads]
    if not missing:
        return
    where = script.source_map.where(reads[missing[0]]) or script.source_map.notebook
    others = f" (also: {', '.join(missing[1:])})" if len(missing) > 1 else ""
    raise CellError(
        f"{where}: the training code uses {missing[0]!r}{others}, which no exported cell or parameter defines, so "
        "every rank would fail with a NameError. Define it in a '#| ddp' cell (or the parameters cell): cells "
        "without a tag run only in the kernel, never in the ranks.")
