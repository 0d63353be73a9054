"""What a detached run's supervisor is asked to run, and the error it answers with: JSON, never a pickle.

The request (``nbddp run``'s :class:`~nbddp.doors.notebook_run.RunOptions`, or ``%%ddp_train``'s
:class:`~nbddp.job.orchestrator.RunRequest` with its script) crosses from the door to a supervisor
process through the run dir, and the judged error crosses back to whichever kernel attaches. A pickle
there runs code as the user for anyone who can swap the file (DESIGN.md, "Shared machines"), so both are
plain data: frozen dataclasses written field by field (paths as text, tuples as lists, nested dataclasses
as objects, the parameters' values as the Python literals they are) and rebuilt from their type hints,
which also validates them again on the way back (the options' own checks). And what is read back must be
the user's own (:func:`nbddp.contracts.owned.read_owned`): the request says which code the ranks run.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from nbddp.contracts import errors
from nbddp.contracts.atomic import write_text
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.owned import read_owned

_LITERAL = "literal"
"""An ``Any`` value (a parameter's) is written as ``{"literal": repr(value)}`` and read with ``ast.literal_eval``:
parameters are literals by construction (:mod:`nbddp.notebook.literals`), and a tuple stays a tuple."""


def write_request(paths: RunDir, what: Any) -> None:
    """``what`` (``RunOptions`` or a ``RunRequest`` with no warm ranks) as ``detached/request.json``."""
    if getattr(what, "warm", None) is not None:
        raise ValueError("a detached run starts ranks of its own: its request has no warm ranks")
    write_text(paths.detached_request, json.dumps({"kind": type(what).__name__, "request": _encode(what)}))


def read_request(paths: RunDir) -> Any:
    """The request :func:`write_request` wrote, read only from a file that is the user's alone.

    Raises:
        NotYours: the file, or its run dir, isn't the user's alone. ValueError: it isn't a request.
    """
    from nbddp.doors.notebook_run import RunOptions
    from nbddp.job.orchestrator import RunRequest

    data = json.loads(read_owned(paths.detached_request, "the detached run's request"))
    kinds = {cls.__name__: cls for cls in (RunOptions, RunRequest)}
    if not isinstance(data, dict) or data.get("kind") not in kinds:
        raise ValueError(f"{paths.detached_request} is not a detached run's request")
    return _decode(data["request"], kinds[data["kind"]])


def write_error(paths: RunDir, error: BaseException) -> None:
    """The judged error of a detached run that didn't succeed, as ``detached/error.json``: its class (one of
    nbddp's), message and, for a :class:`~nbddp.contracts.errors.RunError`, the fields it carries."""
    fields = {name: getattr(error, name) for name in getattr(error, "FIELDS", ())}
    write_text(paths.detached_error,
               json.dumps({"type": type(error).__name__, "message": str(error), "fields": fields}))


def read_error(paths: RunDir) -> errors.NbddpError | None:
    """The error :func:`write_error` wrote (``None``: there is none, it isn't the user's, or it isn't one)."""
    try:
        data = json.loads(read_owned(paths.detached_error, "the detached run's error"))
        cls = getattr(errors, data["type"])
        if not (isinstance(cls, type) and issubclass(cls, errors.NbddpError)):
            return None
        if issubclass(cls, errors.RunError):
            return cls(data["message"], **{k: v for k, v in data["fields"].items() if k in cls.FIELDS})
        return cls(data["message"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, errors.NbddpError):
        return None


def _encode(value: Any, hint: Any = None) -> Any:
    """``value`` (of type ``hint``, or its own dataclass) as JSON data :func:`_decode` reads back as it was."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # (``X | None``: a value that isn't None is an X)
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if hint is Any and not (value is None or isinstance(value, (bool, int, float, str))):
        return {_LITERAL: repr(value)}  # a parameter's tuple, set or complex stays what it is
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = typing.get_type_hints(type(value))
        return {field.name: _encode(getattr(value, field.name), hints[field.name])
                for field in dataclasses.fields(value)}
    args = typing.get_args(hint)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args or (None,) * len(value)
        return [_encode(item, item_hint) for item, item_hint in zip(value, items)]
    if isinstance(value, dict):
        return {str(key): _encode(item, args[1] if len(args) == 2 else None) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{type(value).__name__} can't be written into a detached run's request")


def _decode(data: Any, hint: Any) -> Any:
    """``data`` (from :func:`_encode`) as a value of type ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return ast.literal_eval(data[_LITERAL]) if isinstance(data, dict) and set(data) == {_LITERAL} else data
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        return _decode(data, next(arg for arg in args if arg is not type(None)))
    if origin is tuple:
        items = args[:1] * len(data) if len(args) == 2 and args[1] is Ellipsis else args
        return tuple(_decode(item, item_hint) for item, item_hint in zip(data, items, strict=True))
    if origin is dict:
        return {key: _decode(item, args[1]) for key, item in data.items()}
    if hint is Path:
        return Path(data)
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{field.name: _decode(data[field.name], hints[field.name])
                       for field in dataclasses.fields(hint) if field.init and field.name in data})
    if hint is float and isinstance(data, int):
        return float(data)
    if not isinstance(data, hint):
        raise ValueError(f"{data!r} is not a {hint.__name__}")
    return data
