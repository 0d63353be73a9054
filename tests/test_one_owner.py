"""Each fact has one owner (docs/architecture.md's table): checked in the package's source, so that a
second copy can't creep back in. Comments and docstrings don't count: only code (its tokens)."""

from __future__ import annotations

import io
import re
import tokenize
from collections import defaultdict
from pathlib import Path

import nbddp

PACKAGE = Path(nbddp.__file__).parent


def _tokens() -> dict[str, list[tokenize.TokenInfo]]:
    """Each module's code tokens: comments and docstrings (strings standing as statements) left out."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        code, previous = [], tokenize.NEWLINE
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type in (tokenize.COMMENT, tokenize.NL):
                continue
            statement_start = previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
            if not (token.type == tokenize.STRING and statement_start):
                code.append(token)
            previous = token.type
        found[str(path.relative_to(PACKAGE))] = code
    return found


TOKENS = _tokens()


def _where(test) -> set[str]:
    """The modules with a token for which ``test(token)`` holds."""
    return {module for module, tokens in TOKENS.items() if any(test(token) for token in tokens)}


def _string(token: tokenize.TokenInfo) -> str | None:
    if token.type != tokenize.STRING:
        return None
    import ast

    try:
        return str(ast.literal_eval(token.string))
    except (SyntaxError, ValueError):  # an f-string with fields
        return token.string


def test_every_nbddp_variable_is_spelled_in_one_module():
    spelled: dict[str, set[str]] = defaultdict(set)
    for module, tokens in TOKENS.items():
        for token in tokens:
            value = _string(token)
            if value is not None and re.fullmatch(r"NBDDP_[A-Z_]+", value):
                spelled[value].add(module)
    assert spelled and {name: modules for name, modules in spelled.items() if len(modules) > 1} == {}
    assert {name for name, modules in spelled.items() if modules == {"contracts/rank_env.py"}} >= {
        "NBDDP_RUN_DIR", "NBDDP_DEVICE", "NBDDP_NPROC", "NBDDP_WARM"}


def test_exit_codes_have_one_owner():
    assert _where(lambda t: t.type == tokenize.NUMBER and t.string in ("124", "128", "130")) == {"contracts/status.py"}


def test_the_run_dirs_script_name_has_one_owner():
    assert _where(lambda t: _string(t) == "train.py") == {"contracts/rundir.py"}


def test_the_run_dirs_file_patterns_have_one_owner():
    """Which files a run dir holds of each kind (every rank's report, mark, error, log): found through ``RunDir``."""
    patterns = ("rank-*.json", "rank-*.done", "memory-*.json", "node-*.log", "rank-*.log", "*/result.json")
    assert _where(lambda t: any(p in (_string(t) or "") for p in patterns)) == {"contracts/rundir.py"}


def test_torchruns_command_line_is_written_once():
    written = _where(lambda t: any(word in (_string(t) or "")
                                   for word in ("--nproc-per-node", "--rdzv-backend", "--standalone")))
    assert written == {"engines/torch.py"}


def test_files_other_processes_read_are_written_whole_in_one_place():
    renames = _where(lambda t: t.type == tokenize.NAME and t.string == "replace") & _where(
        lambda t: t.type == tokenize.NAME and t.string == "os")
    assert "contracts/atomic.py" in renames
    assert {m for m in renames if "os.replace(" in (PACKAGE / m).read_text()} == {"contracts/atomic.py"}
    assert _where(lambda t: ".partial" in (_string(t) or "")) == {"contracts/atomic.py"}  # (its _SUFFIX, and no other)


def test_metric_counters_have_one_owner():
    """The list of keys that count rather than measure (the live view and the terminal read epoch/epochs
    for their progress bars, which is what those keys mean, not a second list)."""
    assert _where(lambda t: _string(t) == "epoch") & _where(lambda t: _string(t) == "step") == {"contracts/metrics.py"}


def test_stop_graces_have_one_owner():
    """Every stop's grace comes from its launcher (``stop_grace``) or process_groups' two constants: no literal
    ``grace=`` nor a ``…GRACE… =`` table of its own elsewhere (a batch's run, ``nbddp kill``, a detached run)."""
    literal = set()
    for module, tokens in TOKENS.items():
        for name, equals, value in zip(tokens, tokens[1:], tokens[2:]):
            if "grace" in name.string.lower() and equals.string == "=" and value.type == tokenize.NUMBER:
                literal.add((module, name.string))
    assert literal == {("contracts/process_groups.py", "STOP_GRACE"),
                       ("launchers/ray.py", "RANK_GRACE"),  # a part of the Ray launcher's stop_grace, STOP_SECONDS
                       ("job/lifecycle.py", "RENDEZVOUS_GRACE_SECONDS")}  # not a stop: the nodes' time to meet


def test_a_whole_runs_stop_grace_is_its_launchers_and_the_time_to_record():
    from nbddp.launchers import run_stop_grace
    from nbddp.contracts.process_groups import RECORD_SECONDS, STOP_GRACE
    from nbddp.launchers.ray import STOP_SECONDS
    from nbddp.launchers.slurm import CANCEL_SECONDS
    from nbddp.plan.options import LaunchOptions, RayRequest, SlurmRequest

    assert run_stop_grace(LaunchOptions()) == STOP_GRACE + RECORD_SECONDS
    assert run_stop_grace(LaunchOptions(slurm=SlurmRequest())) == CANCEL_SECONDS + RECORD_SECONDS
    assert run_stop_grace(LaunchOptions(ray=RayRequest())) == STOP_SECONDS + RECORD_SECONDS
