"""The suite's own helpers: :func:`tests.conftest.wait_until`, the one way a test waits for something to happen, and
the rule that keeps it the one way (every poll goes through it, so none can end silently at its deadline)."""

from __future__ import annotations

import ast
import io
import re
import time
import tokenize
from pathlib import Path

import pytest

from tests.conftest import wait_until

TESTS = Path(__file__).resolve().parent
#: Test modules this rule doesn't read: being changed by others as it was written (their polls are theirs to move).
NOT_READ: set[str] = set()
#: Functions whose loops are no waits for an event, or are still to be moved onto ``wait_until``:
#: ``(file, function)``.
EXEMPT = {
    ("conftest.py", "wait_until"),  # the one poll
    ("conftest.py", "_watch"),  # records a run's processes for as long as it runs: no wait
}
#: A hand-written deadline: ``deadline = time.monotonic() + N``, or a loop (or assert) that compares the clock with one.
HAND_WRITTEN_DEADLINE = re.compile(
    r"^\s*\w*deadline\w*\s*=\s*time\.monotonic\(\)"
    r"|^\s*while\b.*time\.monotonic\(\)"
    r"|time\.monotonic\(\)\s*[<>]=?\s*[\w.]*deadline"
    r"|[\w.]*deadline\w*\s*[<>]=?\s*time\.monotonic\(\)", re.M)


def test_wait_until_returns_the_first_truthy_value_it_sees():
    answers = iter([None, 0, "", [], "there", "not asked"])
    assert wait_until(lambda: next(answers), 5, "an answer", every=0) == "there"
    assert next(answers) == "not asked"  # (asked no more once it had one)


def test_wait_until_fails_naming_what_never_happened_the_last_value_and_the_detail():
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        wait_until(lambda: 0, 0.05, "the ranks ended", every=0.01, detail=lambda: "still alive: [12, 13]")
    assert str(failed.value) == "the ranks ended: not within 0.05 s (last seen: 0)\nstill alive: [12, 13]"
    assert 0.05 <= time.monotonic() - started < 5
    with pytest.raises(AssertionError, match=r"^the log said 'step 3': not within 0\.02 s$"):
        wait_until(lambda: False, 0.02, "the log said 'step 3'", every=0.01)


def test_a_condition_that_knows_it_never_will_ends_the_wait_at_once():
    def exited():
        raise AssertionError("the server exited (1)")

    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"^the server exited \(1\)$"):
        wait_until(exited, 60, "the server answered")
    assert time.monotonic() - started < 5


def _modules():
    for path in sorted(TESTS.glob("*.py")):
        if path.name not in NOT_READ:
            yield path, path.read_text(encoding="utf-8")


def _exempt_lines(path: Path, tree: ast.AST) -> set[int]:
    """The line numbers of :data:`EXEMPT`'s functions in ``path``."""
    return {number for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (path.name, node.name) in EXEMPT
            for number in range(node.lineno, node.end_lineno + 1)}


def _code(path: Path, text: str) -> str:
    """``text``'s code: its strings and comments (a script a test runs elsewhere, a docstring about polls) and the
    lines of :data:`EXEMPT`'s functions blanked, the line numbers kept."""
    lines = [list(line) for line in text.splitlines(keepends=True)]
    blanked = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in blanked:
            (first, start), (last, end) = token.start, token.end
            for number in range(first, last + 1):
                line = lines[number - 1]
                for column in range(start if number == first else 0, end if number == last else len(line)):
                    if line[column] != "\n":
                        line[column] = " "
    for number in _exempt_lines(path, ast.parse(text)):
        lines[number - 1] = ["\n"]
    return "".join("".join(line) for line in lines)


def test_no_test_writes_a_deadline_of_its_own():
    """A ``while ... and time.monotonic() < deadline`` that ends at its deadline lets the test go on as if what it
    waited for had happened: every poll is ``wait_until(condition, timeout, what)``, which fails naming it."""
    found = []
    for path, text in _modules():
        scanned = _code(path, text)
        for match in HAND_WRITTEN_DEADLINE.finditer(scanned):
            line = scanned.count("\n", 0, match.start()) + 1
            found.append(f"{path.name}:{line}: {text.splitlines()[line - 1].strip()}")
    assert not found, "a hand-written deadline: use tests.conftest.wait_until\n" + "\n".join(found)


def test_no_test_polls_in_a_sleeping_loop():
    """``while not done(): time.sleep(...)`` waits for ever, or until pytest's timeout names nothing: the same rule."""
    found = []
    for path, text in _modules():
        tree = ast.parse(text)
        exempt = _exempt_lines(path, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.While) and node.lineno not in exempt and any(
                    isinstance(call, ast.Call) and ast.unparse(call.func) in ("time.sleep", "sleep")
                    for call in ast.walk(node)):
                found.append(f"{path.name}:{node.lineno}: while {ast.unparse(node.test)}")
    assert not found, "a loop that sleeps until something happens: use tests.conftest.wait_until\n" + "\n".join(found)


def test_the_rule_finds_the_hand_written_deadlines_it_forbids():
    written = ("    deadline = time.monotonic() + 30\n"
               "    while actor_processes() and time.monotonic() < deadline:\n"
               "        time.sleep(0.2)\n"
               "    while True:\n"
               "        assert time.monotonic() < deadline, 'never'\n"
               "        if time.monotonic() > self.deadline:\n")
    assert len(HAND_WRITTEN_DEADLINE.findall(written)) == 4
    allowed = ("    started = time.monotonic()\n"
               "    assert time.monotonic() - started < 5\n"
               '    SLOW = "try:\\n    end = time.monotonic() + 5\\n    while time.monotonic() < end:\\n"\n')
    assert HAND_WRITTEN_DEADLINE.findall(allowed) == []
