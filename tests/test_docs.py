"""The documentation: a site MkDocs builds strictly, written to be read, and every example in it either run here or
saying which test covers it.

Each fenced block of a page is one of:

* ``text``: what a run prints, or a transcript; right after a block that runs, marked ``<!-- output … -->``, it is
  what that block must print (``…`` stands for anything, a number for any number);
* ``bash`` or ``python`` marked ``<!-- runs: … -->``: run here, on CPU ranks, from the repository's root (a bash block
  line by line, a python block as a script);
* ``bash`` or ``python`` marked ``<!-- not run: why; … tests/test_x.py … -->``: not runnable here (a GPU, a Slurm
  cluster, a notebook's cells), naming the test that runs what it shows.

A renamed option or a changed line fails here before a reader meets it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted(p for p in (REPO / "docs").rglob("*.md") if "notes" not in p.parts)  # (notes: research, not pages)
DOCUMENTS = [REPO / "README.md", *PAGES]
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!-- (runs|not run|output)\b:?(.*?)-->\s*$")
#: The longest line a page may hold, tables and code aside (a table's row is one line, whatever its length).
LONGEST = 120


@dataclass(frozen=True)
class Block:
    document: Path
    line: int
    language: str
    code: str
    mark: str
    """``runs``, ``not run``, ``output`` or ``""``."""
    why: str

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(REPO)}:{self.line}"


def blocks(document: Path) -> list[Block]:
    """The fenced blocks of ``document``, each with the mark on the line before it."""
    lines = document.read_text(encoding="utf-8").splitlines()
    found, index = [], 0
    while index < len(lines):
        opened = _FENCE.match(lines[index])
        if not opened:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        mark = _MARK.match(before.strip())
        found.append(Block(document, index + 1, opened.group(1), "\n".join(lines[index + 1:end]),
                           mark.group(1) if mark else "", mark.group(2).strip() if mark else ""))
        index = end + 1
    return found


EVERY_BLOCK = [block for document in DOCUMENTS for block in blocks(document)]


def test_every_block_says_what_it_is_and_every_example_is_run_or_names_its_test():
    wrong = []
    for block in EVERY_BLOCK:
        if block.language not in ("bash", "python", "text"):
            wrong.append(f"{block.where}: a block of {block.language or 'no language'}: say bash, python or text")
        elif block.language != "text" and block.mark not in ("runs", "not run"):
            wrong.append(f"{block.where}: a {block.language} block with no <!-- runs --> or <!-- not run: … --> mark")
        elif block.mark == "not run" and not re.search(r"tests/test_\w+\.py|\.ci/run|not runnable", block.why):
            wrong.append(f"{block.where}: not run, but names no test that covers it")
    for name in re.findall(r"tests/test_\w+\.py", " ".join(b.why for b in EVERY_BLOCK)):
        if not (REPO / name).exists():
            wrong.append(f"a mark names {name}, which doesn't exist")
    assert not wrong, "\n".join(wrong)


def test_pages_are_written_to_be_read():
    """No line over 120 characters (tables and code aside), no link out of the repository, no developer's notes."""
    wrong = []
    for document in DOCUMENTS:
        in_code = False
        for number, line in enumerate(document.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{document.relative_to(REPO)}:{number}"
            if line.startswith("```"):
                in_code = not in_code
                continue
            if in_code:
                continue
            if len(line) > LONGEST and not line.startswith("|"):
                wrong.append(f"{where}: {len(line)} characters")
            if re.search(r"\]\((?:\.\./)+(?!docs/|README)", line) or "../shared" in line:
                wrong.append(f"{where}: a link out of the repository")
            if re.search(r"this time|not yet run|this kind of machine|on this 2-core machine", line, re.I):
                wrong.append(f"{where}: a developer's note (say what is, measured, with its command)")
    assert not wrong, "\n".join(wrong)


#: A sentence longer than this reads as two: split it ("under ~30 words", counting a `code span` as one).
WORDS = 32
#: Words that tell the docs' history instead of what is.
_HISTORY = re.compile(r"\b(was|were|since|this time|used to|no longer|previously|formerly)\b", re.I)


def sentences(document: Path) -> list[tuple[int, str]]:
    """The prose of ``document`` (code blocks, tables, headings and markers aside), sentence by sentence, each with
    the line its paragraph starts on."""
    found, paragraph, start, in_code = [], [], 0, False

    def close() -> None:
        text = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "X", " ".join(paragraph)))
        found.extend((start, s) for s in re.split(r"(?<=[.!?:;])\s+(?=[A-Z`*(\[-])", " ".join(text.split())) if s)
        paragraph.clear()

    for number, line in enumerate(document.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):  # (a block inside a list item is indented)
            in_code = not in_code
        if in_code or line.lstrip().startswith(("```", "|", "#", "<!--", "![")) or not line.strip():
            close()
            continue
        if not paragraph:
            start = number
        paragraph.append(line)
    close()
    return found


def test_sentences_are_short_and_say_what_is():
    """One idea per sentence, in the present tense: no sentence over WORDS words, no history."""
    wrong = []
    for document in DOCUMENTS:
        for line, sentence in sentences(document):
            where = f"{document.relative_to(REPO)}:{line}"
            if len(sentence.split()) > WORDS:
                wrong.append(f"{where}: {len(sentence.split())} words: {sentence[:80]}…")
            if history := _HISTORY.search(sentence):
                wrong.append(f"{where}: '{history.group(0)}' (say what is): {sentence[:80]}…")
    assert not wrong, f"{len(wrong)} sentences:\n" + "\n".join(wrong)


def test_every_picture_is_shown_and_every_one_shown_is_there():
    """The pictures under docs/img (written by the tests that take them, tests.conftest.docs_image) and the pages
    showing them: none missing, none left over."""
    shown = set()
    for document in DOCUMENTS:
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", document.read_text(encoding="utf-8")):
            picture = (document.parent / target).resolve()
            assert picture.is_file(), f"{document.relative_to(REPO)} shows {target}, which isn't there"
            shown.add(picture)
    kept = {p.resolve() for p in (REPO / "docs" / "img").iterdir()}
    assert kept <= shown, f"pictures no page shows: {sorted(p.name for p in kept - shown)}"
    assert {"ddp_train_live.png", "ddp_ranks.png", "batch_summary.png"} <= {p.name for p in kept}


def test_the_readme_is_a_landing_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    first = readme.index("```bash")
    assert "pip install" in readme[first:readme.index("```", first + 3)], "the first block installs and runs"


def test_the_reference_is_the_tools_own_words():
    """The command-line reference is each parser's --help, written as the site is built (docs/hooks.py)."""
    sys.path.insert(0, str(REPO / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(REPO / "docs"))
    from nbddp.doors.cli import _commands, build_parser
    from nbddp.plan.options import options_table

    page = (REPO / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    for command in ["nbddp", *(f"nbddp {name}" for name in _commands(build_parser()))]:
        assert f"<!-- nbddp:help {command} -->" in page, f"the reference lacks {command}"
    for magic in ("%%ddp_train", "%%ddp_exec", "%ddp_ranks", "%ddp_attach", "%ddp_debug", "%ddp_doctor"):
        assert f"<!-- nbddp:help {magic} -->" in page, f"the reference lacks {magic}"
    shown = hooks.on_page_markdown("<!-- nbddp:help nbddp run -->", None, None, None)
    done = subprocess.run([sys.executable, "-m", "nbddp", "run", "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": hooks.HELP_COLUMNS}, timeout=60)
    assert shown == "```text\n" + done.stdout.rstrip() + "\n```"
    assert hooks.on_page_markdown("<!-- nbddp:options -->", None, None, None) == options_table()


def test_every_troubleshooting_link_an_error_gives_is_a_heading_there():
    from nbddp.contracts.errors import SEE

    headings = {_anchor(h) for h in re.findall(r"^## (.+)$", (REPO / "docs" / "troubleshooting.md").read_text(), re.M)}
    given = set()
    for path in (REPO / "nbddp").rglob("*.py"):
        given |= set(re.findall(r"see\(\"([a-z0-9-]+)\"\)", path.read_text(encoding="utf-8")))
    assert given and given <= headings, given - headings
    assert SEE.endswith("docs/troubleshooting.md#")


def _anchor(heading: str) -> str:
    """MkDocs' id of a heading: Python-Markdown's toc slug."""
    import unicodedata

    value = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


@pytest.mark.slow
@pytest.mark.waits  # (mostly the site generator's own imports; in .ci/run's clusters lane, beside the others)
def test_the_site_builds_with_no_warning(tmp_path):
    mkdocs = pytest.importorskip("mkdocs") if os.environ.get("NBDDP_REQUIRE_EXTRAS") != "1" else __import__("mkdocs")
    assert mkdocs
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0 and "WARNING" not in done.stderr, done.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


RUNS = [block for block in EVERY_BLOCK if block.mark == "runs"]


@pytest.mark.slow
@pytest.mark.waits
@pytest.mark.parametrize("block", RUNS, ids=[block.where for block in RUNS])
def test_each_example_marked_runs_runs_and_prints_what_its_page_shows(block, leave_the_checkout_as_it_was):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NBDDP_PREPARE_AHEAD": "0"}
    if block.language == "bash":
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env={**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"})
    else:
        done = subprocess.run([sys.executable, "-c", block.code], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env=env)
    assert done.returncode == 0, f"{block.where}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    shown = _output_of(block)
    if shown is not None:
        printed = done.stdout + done.stderr
        for line in shown.splitlines():
            assert re.search(_pattern(line), printed, re.M), f"{block.where} printed no line like {line!r}:\n{printed}"


@pytest.fixture
def leave_the_checkout_as_it_was():
    """The examples run from the repository's root, as a reader would: the run dirs they make go afterwards."""
    import shutil
    import time

    started = time.time()
    yield
    for folder in (REPO / "notebooks").glob("runs/*"):
        if folder.stat().st_mtime >= started - 1:
            shutil.rmtree(folder, ignore_errors=True)
    runs = REPO / "notebooks" / "runs"
    if runs.is_dir() and not any(runs.iterdir()):
        runs.rmdir()
    for written in Path("/tmp").glob("nbddp-docs-*"):  # (docs/cli.md's export writes there, as a reader's would)
        written.unlink()


def _output_of(block: Block) -> str | None:
    following = [b for b in EVERY_BLOCK if b.document == block.document and b.line > block.line]
    if following and following[0].mark == "output":
        return following[0].code
    return None


def _pattern(line: str) -> str:
    """A shown line as a pattern: ``…`` anything, a number any number."""
    parts = re.split(r"(…|\d+(?:\.\d+)?)", line)
    out = []
    for part in parts:
        if part == "…":
            out.append(".*?")
        elif re.fullmatch(r"\d+(?:\.\d+)?", part or "x"):
            out.append(r"\d+(?:\.\d+)?")
        else:
            out.append(re.escape(part))
    return "^" + "".join(out)
