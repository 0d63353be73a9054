"""The package's docstrings follow the one convention docs/architecture.md names ("Docstrings"): prose that
says why, arguments named in it (``name``), no ``Args:`` section; a Google-style ``Raises:`` section where a
function raises what its caller should handle, each entry ``ExceptionName: when``."""

from __future__ import annotations

import ast
import re

from tests.test_import_graph import MODULES

_ENTRY = re.compile(r"^(?:[A-Z][A-Za-z0-9_.]*)(?:, [A-Z][A-Za-z0-9_.]*)*: \S")


def _docstrings():
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node, clean=True)
                if text:
                    yield f"{module}:{getattr(node, 'name', '')}", text


def test_no_docstring_has_an_args_section_and_every_raises_section_names_its_exceptions():
    wrong, raises = [], 0
    for where, text in _docstrings():
        lines = text.splitlines()
        if any(line.strip() in ("Args:", "Arguments:", "Parameters", "Parameters:") for line in lines):
            wrong.append(f"{where}: an argument section (name arguments in the prose)")
        for i, line in enumerate(lines):
            if line.strip() != "Raises:":
                continue
            raises += 1
            entries = []
            for entry in lines[i + 1:]:
                if not entry.startswith("    "):
                    break  # (the section ends at the first line that isn't indented under it)
                if not entry.startswith("        "):  # (deeper: an entry's continuation)
                    entries.append(entry)
            if not entries or not all(_ENTRY.match(entry.strip()) for entry in entries):
                wrong.append(f"{where}: a Raises: entry that isn't 'ExceptionName: when'")
    assert raises > 40  # (the convention is in use, not vacuous)
    assert wrong == []
