"""Every import a test needs comes from the project's own files: a fresh venv made from them has it.

This machine's Python ships packages a contributor's venv lacks (boto3 among them), and a test that imports one of
them through a library (AIToolbox's ``import boto3``) passes here and fails there. This check makes the fresh venv's
absence visible here: it computes what the project declares (``nbddp[test]``'s requirements, followed through each
installed requirement's own, plus what ``.ci/run`` installs beside the extra), then imports every module the tests,
their notebooks and the example notebooks name, in a fresh interpreter where any top-level module that only an
undeclared distribution provides can't be found, as in that venv. A module that imports here but not there names
the undeclared distribution it needs.

The modules are found in the text of the tests (their own imports and the cells they write as strings), the
example notebooks and the modules the tests ask for by name (``need("…")``), so a notebook cell written by a test
counts as much as the test's own ``import``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# (a fresh interpreter imports every library the tests use, ~15 CPU-seconds; no timing asserted: .ci/run's beside lane)
pytestmark = [pytest.mark.slow, pytest.mark.beside]

REPO = Path(__file__).resolve().parent.parent
#: What .ci/run installs beside ``nbddp[test]`` (the vendored Catalyst wheel, with its requirements; AIToolbox
#: with ``--no-deps``, so that its own requirements are not declared by it: what its modules import must be in
#: the test extra; uv, which makes the newest Python's venv), and what every fresh venv has.
BESIDE_THE_EXTRA = ("catalyst", "uv", "pip", "setuptools")
WITHOUT_ITS_REQUIREMENTS = ("aitoolbox",)
#: Names the tests' text imports that are not modules to look for (the project's own, and a test's made-up ones).
OURS = ("nbddp", "tests", "benchmarks")

_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+([A-Za-z_][\w.]*)[ \t]+import\b|import[ \t]+([A-Za-z_][\w.]*))", re.M)
_NEEDED = re.compile(r"""\b(?:need|importorskip)\(\s*["']([A-Za-z_][\w.]*)["']""")


def declared() -> set[str]:
    """Canonical names of every distribution the project's own files install."""
    seen: dict[str, set[str]] = {}
    todo: list[tuple[str, frozenset[str]]] = [("nbddp", frozenset({"test"})),
                                               *((name, frozenset()) for name in BESIDE_THE_EXTRA)]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and extras <= seen[key]:
            continue
        seen.setdefault(key, set()).update(extras)
        try:
            requirements = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        for text in requirements:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in (extras or {""})):
                todo.append((requirement.name, frozenset(requirement.extras)))
    return {*seen, *map(canonicalize_name, WITHOUT_ITS_REQUIREMENTS)}


def undeclared_top_level_modules(declared_distributions: set[str]) -> dict[str, dict[str, str]]:
    """Top-level modules that only undeclared distributions provide → those distributions → where each put it
    (a library's own copy elsewhere, as Ray's of colorama, stays importable)."""
    found: dict[str, dict[str, str]] = {}
    for module, dists in packages_distributions().items():
        if module in sys.stdlib_module_names or module.startswith("_distutils"):
            continue
        if all(canonicalize_name(d) not in declared_distributions for d in dists):
            found[module] = {canonicalize_name(d): str(Path(distribution(d).locate_file(module))) for d in dists}
    return found


def modules_the_tests_name() -> dict[str, str]:
    """Every absolute module the tests and the example notebooks name → the first file that names it."""
    files = [*sorted((REPO / "tests").glob("*.py")), *sorted((REPO / "notebooks").glob("*.ipynb"))]
    named: dict[str, str] = {}
    for path in files:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".ipynb":
            text = "\n".join("".join(cell["source"]) for cell in json.loads(text)["cells"])
        for match in (*_IMPORT.finditer(text), *_NEEDED.finditer(text)):
            module = next(group for group in match.groups() if group)
            if module.split(".")[0] not in OURS:
                named.setdefault(module, str(path.relative_to(REPO)))
    return named


_IMPORTER = """
import importlib, importlib.abc, importlib.machinery, json, re, sys
absent, absent_distributions, modules = (json.loads(argument) for argument in sys.argv[1:4])

class FreshVenv(importlib.abc.MetaPathFinder):
    # The path finder, as a venv without the undeclared distributions has it: their modules not found (find_spec
    # is None, as a library's availability check expects), their metadata not listed.
    def find_spec(self, name, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        where = [spec.origin or "", *(spec.submodule_search_locations or ())] if spec is not None else []
        for root in absent.get(name, ()):
            if any(w == root or w.startswith((root + "/", root + ".")) for w in where):
                return None
        return spec

    def find_distributions(self, *args, **kwargs):
        for found in importlib.machinery.PathFinder.find_distributions(*args, **kwargs):
            if re.sub(r"[-_.]+", "-", (found.metadata["Name"] or "")).lower() not in absent_distributions:
                yield found

    def invalidate_caches(self):
        importlib.machinery.PathFinder.invalidate_caches()

sys.meta_path[:] = [FreshVenv() if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]
failed = {}
for module in modules:
    try:
        importlib.import_module(module)
    except BaseException as exc:
        failed[module] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed))
"""


def failing_imports(modules: list[str], absent: dict[str, dict[str, str]]) -> dict[str, str]:
    """The modules among ``modules`` that a fresh interpreter can't import, with ``absent``'s top-level modules
    (where their distributions put them) and those distributions missing from it; each with its error."""
    distributions = sorted({d for dists in absent.values() for d in dists})
    roots = {module: sorted(dists.values()) for module, dists in absent.items()}
    done = subprocess.run([sys.executable, "-c", _IMPORTER, json.dumps(roots), json.dumps(distributions),
                           json.dumps(modules)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={"PYTHONSAFEPATH": "1",
                                                                            **_quiet_environment()})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _quiet_environment() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3"}


def test_every_module_the_tests_import_comes_from_a_declared_distribution():
    named = modules_the_tests_name()
    absent = undeclared_top_level_modules(declared())
    without = failing_imports(sorted(named), absent)
    if not without:
        return
    with_them = failing_imports(sorted(without), {})  # what fails here too is not about the install
    missing = [f"{module} (named in {named[module]}): {without[module]}" for module in sorted(without)
               if module not in with_them]
    assert not missing, (
        "imports that work here only because this Python has packages the project doesn't install "
        "(add them to the test extra in pyproject.toml, or to .ci/run):\n  " + "\n  ".join(missing)
        + f"\n(undeclared here: {', '.join(sorted({d for ds in absent.values() for d in ds}))})")


def test_the_check_sees_an_undeclared_distribution():
    """The check itself: a module that imports a blocked top-level name fails, naming it."""
    import email

    failed = failing_imports(["json", "email.mime.text"], {"email": {"email": str(Path(email.__file__).parent)}})
    assert "json" not in failed and "No module named 'email" in failed["email.mime.text"]
