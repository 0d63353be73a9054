"""Parameters (papermill's ``-p NAME VALUE``) as safe script code.

papermill escapes parameter *values* but splices *names* raw; here names must be
identifiers that aren't keywords, and a value is written only as a literal that
is proven to read back equal to itself (``ast.literal_eval``), so nothing the
user didn't write can ever execute.
"""

from __future__ import annotations

import ast
import keyword
import math
from typing import Any

from nbddp.contracts.errors import ParameterError

_PLAIN_SCALARS = (bool, int, float, str, bytes, type(None))


def check_name(name: str) -> str:
    """Return ``name`` if it can be assigned to in Python, else raise ParameterError."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ParameterError(
            f"parameter name {name!r} is not a valid Python variable name. "
            "Use letters, digits and underscores, not starting with a digit, and not a keyword."
        )
    return name


class Unquoted(str):
    """A ``-p`` value typed as text that doesn't read as a Python literal (``-p lr abc``, where ``-p lr 0.1`` reads as a
    number and ``-p lr "'abc'"`` as text). It is text, kept apart so that a parameter whose default isn't text refuses
    it before anything runs (:func:`nbddp.notebook.parameters.type_notices`): there, it is a typo far more often than
    text meant."""


def parse_value(text: str) -> Any:
    """Parse a command-line value as papermill does: a Python literal if it is one, else the string
    (:class:`Unquoted`)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return Unquoted(text)
    return value if is_plain_data(value) else Unquoted(text)


def parse_pairs(pairs: list[tuple[str, str]] | None) -> dict[str, Any]:
    """``[(name, text), ...]`` from argparse → ``{name: value}``, names checked."""
    return {check_name(name): parse_value(text) for name, text in pairs or ()}


def is_plain_data(value: Any, _depth: int = 0) -> bool:
    """True for numbers, strings, bools, None and lists/tuples/dicts/sets of these."""
    if _depth > 50:
        return False
    if isinstance(value, _PLAIN_SCALARS) or isinstance(value, complex):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(is_plain_data(v, _depth + 1) for v in value)
    if isinstance(value, dict):
        return all(is_plain_data(k, _depth + 1) and is_plain_data(v, _depth + 1) for k, v in value.items())
    return False


def to_literal(value: Any) -> str:
    """Python source that evaluates to ``value`` exactly.

    Raises:
        ParameterError: the value is not plain data, or would not round-trip.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, Unquoted):
        value = str(value)  # (plain text, as the script reads it back)
    if not is_plain_data(value):
        raise ParameterError(
            f"parameter value of type {type(value).__name__} can't be passed to the ranks; "
            "use numbers, strings, bools, None, or lists/tuples/dicts of these."
        )
    text = repr(value)
    try:
        ok = ast.literal_eval(text) == value and type(ast.literal_eval(text)) is type(value)
    except (ValueError, SyntaxError):  # e.g. nan nested in a list
        ok = False
    if not ok:
        raise ParameterError(f"parameter value {text[:80]} can't be written as an exact Python literal.")
    return text


def assignments(parameters: dict[str, Any]) -> list[str]:
    """One ``name = literal`` line per parameter, in the given order."""
    return [f"{check_name(name)} = {to_literal(value)}" for name, value in parameters.items()]
