"""A cell's syntax tree, parsed once however many readers ask: the names it reads and binds
(:mod:`.freevars`), the parameters it declares (:mod:`nbddp.notebook.parameters`), the engine it calls for
(:mod:`nbddp.engines.reading`). Cached by the code itself, so the same cell read again (by another reader,
or by the next run of a kernel) costs a dictionary lookup. Readers only read the tree they are given.
"""

from __future__ import annotations

import ast
import functools


@functools.lru_cache(maxsize=2048)
def tree(code: str) -> ast.Module:
    """``code``'s tree, shared by every reader.

    Raises:
        SyntaxError: ``code`` isn't Python (asked again, it is parsed again: errors aren't cached).
    """
    return ast.parse(code)


def tree_or_none(code: str) -> ast.Module | None:
    """``code``'s tree, or ``None`` where it isn't Python."""
    try:
        return tree(code)
    except SyntaxError:
        return None
