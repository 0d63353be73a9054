"""``papermill --engine nbddp`` against papermill's own engine, on papermill's own test notebooks.

Each case is one of papermill's test notebooks (``tests/notebooks/papermill``) with the arguments
papermill's own test suite gives it (``-k python3`` always, as its tests do), run through papermill's
command line twice, once per engine, in the same folder; and again with two DDP cells appended
(a ``#| ddp`` cell building a tiny model and a ``#| ddp-train`` cell training it), which papermill's
engine runs in its kernel and nbddp's as a DDP job. What a papermill user sees is compared: the
exit status, the exception papermill ends with, whether the output notebook was written, each
code cell's papermill status, error (ename, evalue) and text output, where papermill put its
error marker, and what ``--stdout-file`` received. The DDP cells' own outputs are left out (they
differ by design: every rank's lines against one process's).

``python -m tests.papermill_parity [--only CASE ...] [--markdown docs/papermill.md]`` runs the
whole matrix and writes the table; ``tests/test_papermill_parity.py`` runs a part of it in CI, against
papermill's own engine's results as ``--record`` recorded them (``tests/notebooks/papermill/reference.json``)
while the packages that decide them (papermill, nbclient, nbformat, jupyter_client, ipykernel, IPython, Python)
are the versions of one of its records, and running papermill's engine again otherwise. Where the interpreter and its
packages are installed is left out of what is compared, so a record made in one install serves another.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell

from tests.conftest import wait_until

NOTEBOOKS = Path(__file__).resolve().parent / "notebooks" / "papermill"
ENGINES = ("papermill", "nbddp")
DDP_SETUP = "#| ddp\nimport torch, nbddp\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)"
DDP_TRAIN = ("#| ddp-train\nddp = nbddp.prepare(model)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
             "for step in range(3):\n    opt.zero_grad(); ddp(torch.ones(8, 4)).sum().backward(); opt.step()\n"
             "print('trained', flush=True)")
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception|Interrupt|Exit))\b")
#: pyzmq's log line for an event on a socket closed at shutdown (``ZMQError: not a socket``): logged
#: by tornado, not raised, and seen from papermill's own engine under load; not what a run ended with.
_LOGGED_AND_SURVIVED = re.compile(r"Uncaught exception in ZMQStream callback", re.IGNORECASE)


@dataclass(frozen=True)
class Case:
    """One notebook with the arguments papermill's suite gives it (plus extra cases of our own)."""

    id: str
    notebook: str
    args: tuple[str, ...] = ()
    interrupt_after: float | None = None
    """Send SIGINT (Ctrl-C) to papermill's process group this many seconds after a cell that sleeps started
    (papermill saves the notebook as each cell starts: its status says which one runs)."""
    cells: tuple[str, ...] = ()
    """A notebook of our own: its code cells (``notebook`` names it)."""
    output: str = "out.ipynb"
    """``-`` prints the output notebook on stdout."""
    files: tuple[tuple[str, str], ...] = ()
    """Files the notebook expects beside it (``read_check`` reads one in its ``--cwd``)."""
    intended: str = ""
    """Why nbddp's engine differs on purpose with DDP cells appended (``""``: it doesn't)."""


CASES = (
    Case("simple", "simple_execute.ipynb", ("-p", "msg", "Hello")),
    Case("simple-quoted", "simple_execute.ipynb", ("-p", "msg", '"Hello"')),
    Case("no-parameters", "no_parameters.ipynb", ("-p", "msg", "Hello")),
    Case("broken", "broken.ipynb"),
    Case("broken1", "broken1.ipynb"),
    Case("broken2", "broken2.ipynb"),
    Case("report-mode", "report_mode_test.ipynb", ("-p", "a", "0", "--report-mode")),
    Case("cwd", "read_check.ipynb", ("--cwd", "sub"), files=(("sub/check.txt", "checked\n"),)),
    Case("sysexit", "sysexit.ipynb"),
    Case("sysexit0", "sysexit0.ipynb"),
    Case("sysexit1", "sysexit1.ipynb"),
    Case("systemexit", "systemexit.ipynb"),
    Case("line-magic-error", "line_magic_error.ipynb"),
    Case("nb-4.4", "nb_version_4.4.ipynb", ("-p", "var", "It works")),
    Case("blank-vscode", "blank-vscode.ipynb", ("-p", "var", "It works")),
    Case("complex-parameters", "complex_parameters.ipynb", ("-p", "msg", "Hello")),
    Case("result-no-exec", "result_no_exec.ipynb"),
    Case("logging", "test_logging.ipynb", ("--log-output", "--stdout-file", "stdout.txt", "--stderr-file",
                                           "stderr.txt")),
    Case("stdout-output", "test_notebooknode_io.ipynb", output="-"),
    Case("prepare-only", "keyboard_interrupt.ipynb", ("-p", "foo", "do\\ not\\ crash", "--prepare-only")),
    Case("autosave", "test_autosave.ipynb", ("--autosave-cell-every", "1")),
    Case("no-request-save", "simple_execute.ipynb", ("-p", "msg", "Hello", "--no-request-save-on-cell-execute")),
    Case("r-kernel-notebook", "notimplemented_translator.ipynb", ("-p", "msg", "Hello")),
    Case("binder", "binder.ipynb"),
    # Failures, time limits and interrupts of our own (papermill's suite mocks them)
    Case("kernel-cell-timeout", "sleepy.ipynb", ("--execution-timeout", "5"), cells=("import time", "time.sleep(30)")),
    Case("ctrl-c-in-a-kernel-cell", "sleepy.ipynb", interrupt_after=2.0, cells=("import time", "time.sleep(30)")),
    Case("cell-raising", "raising.ipynb", cells=("x = 1", "raise ValueError(f'bad x {x}')", "print('after')")),
    # nbddp's directive: with nbddp installed, papermill (either engine) injects after a `#| parameters` cell
    Case("parameters-directive", "directive.ipynb", ("-p", "msg", "Hello", "-p", "run_date", "2026-11-25"),
         cells=("#| parameters\nmsg = 'default'", "print('msg is', msg)")),
)


def notebook_for(case: Case, variant: str, folder: Path) -> Path:
    """The case's notebook in ``folder``, as published or with the DDP cells appended."""
    path = folder / case.notebook
    if case.cells:
        nb = nbformat.v4.new_notebook(cells=[new_code_cell(c) for c in case.cells], metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    else:
        nb = nbformat.read(NOTEBOOKS / case.notebook, as_version=4)
    if variant == "ddp":
        nb.cells += [new_code_cell(DDP_SETUP), new_code_cell(DDP_TRAIN)]
    nbformat.write(nb, path)
    for name, text in case.files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return path


def run_case(case: Case, variant: str, engine: str, folder: Path, timeout: float = 180) -> dict:
    """Run ``case`` with ``engine`` in ``folder`` (emptied first); what a papermill user sees, as plain data."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    notebook_for(case, variant, folder)
    argv = [sys.executable, "-m", "papermill", case.notebook, case.output, "-k", "python3", "--no-progress-bar",
            *case.args, *(["--engine", "nbddp"] if engine == "nbddp" else [])]
    env = {**os.environ, "NBDDP_OPTIONS": "--cpu --nproc 2", "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        if case.interrupt_after is not None:
            _wait_for_a_sleeping_cell(folder / case.output, proc, timeout)
            time.sleep(case.interrupt_after)
            os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += "\n[parity: timed out]"
    finally:
        _kill_group(proc.pid)
    seconds = time.monotonic() - started
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    return {"exit": code, "exception": _exception(err), "seconds": round(seconds, 1), **_notebook(case, folder, out),
            "stdout_file": _read(folder / "stdout.txt"), "stderr_tail": err[-1500:]}


def _wait_for_a_sleeping_cell(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    """Until papermill's output notebook shows a cell that sleeps running (the case's interrupt is timed from there)."""

    def running() -> bool:
        try:
            cells = nbformat.read(path, as_version=4).cells
        except (OSError, ValueError, nbformat.reader.NotJSONError):
            cells = []
        if any("sleep" in c.source and c.metadata.get("papermill", {}).get("status") == "running" for c in cells):
            return True
        assert proc.poll() is None, f"papermill exited ({proc.returncode}) before a cell that sleeps ran"
        return False

    wait_until(running, timeout, f"a cell that sleeps running in {path.name}")


def _exception(stderr: str) -> str:
    """The exception papermill ended with (its class name), or click's ``Aborted!``, or ``""``."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if lines and lines[-1] == "Aborted!":
        return "Aborted!"
    found, logged = [], False
    for line in lines:
        if _LOGGED_AND_SURVIVED.search(line):
            logged = True  # its traceback follows: skip to its exception line
        elif m := _EXCEPTION.match(line):
            if not logged:
                found.append(m.group(1))
            logged = False
    return found[-1] if found else ""


def _notebook(case: Case, folder: Path, stdout: str) -> dict:
    try:
        nb = nbformat.reads(stdout, as_version=4) if case.output == "-" else \
            nbformat.read(folder / case.output, as_version=4)
    except (OSError, ValueError, nbformat.reader.NotJSONError) as exc:
        return {"written": False, "stdout_is_notebook": False, "why_not": type(exc).__name__}
    cells = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
        cells.append({"index": index, "ddp": cell.source.startswith("#| ddp"),
                      "status": cell.metadata.get("papermill", {}).get("status"),
                      "ename": errors[0].get("ename") if errors else None,
                      "evalue": errors[0].get("evalue") if errors else None,
                      "text": _plain(text), "source_hidden": bool(cell.metadata.get("jupyter", {}).get("source_hidden"))})
    markers = [i for i, c in enumerate(nb.cells) if "papermill-error-cell-tag" in c.metadata.get("tags", [])]
    return {"written": True, "stdout_is_notebook": case.output == "-", "cells": cells, "markers": markers,
            "nb_exception": nb.metadata.get("papermill", {}).get("exception")}


#: Where an installation puts Python's files: a warning printed by a library names its file under one of them.
_INSTALLED = ((re.compile(r"(?:/[^\s/:'\"]+)+/(?:site|dist)-packages/"), "<site-packages>/"),
              (re.compile(r"(?:/[^\s/:'\"]+)+/lib/python3\.\d+/"), "<stdlib>/"))


def _plain(text: str) -> str:
    """Text output without what differs between any two runs (times, addresses, temp names) or any two installs of
    the same versions (where the interpreter and its packages are: a venv's, pyenv's, a system's)."""
    text = re.sub(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.\d]*", "<time>", text)
    for path, name in _INSTALLED:
        text = path.sub(name, text)
    return re.sub(r"0x[0-9a-f]+|/tmp/[\w./-]+", "<x>", text)


def compare(reference: dict, candidate: dict) -> list[str]:
    """What differs between papermill's engine (``reference``) and nbddp's (``candidate``); ``[]``: parity."""
    differences = []
    for key in ("exit", "exception", "written", "stdout_is_notebook", "markers", "nb_exception"):
        if reference.get(key) != candidate.get(key):
            differences.append(f"{key}: {reference.get(key)!r} → {candidate.get(key)!r}")
    ours, theirs = candidate.get("cells", []), reference.get("cells", [])
    if len(ours) != len(theirs):
        differences.append(f"code cells: {len(theirs)} → {len(ours)}")
    for mine, their in zip(ours, theirs):
        keys = ("status", "source_hidden") if their["ddp"] else ("status", "ename", "evalue", "text", "source_hidden")
        for key in keys:
            if mine[key] != their[key]:
                differences.append(f"cell {their['index']} {key}: {their[key]!r} → {mine[key]!r}")
    if reference.get("stdout_file") is not None:
        missing = [line for line in reference["stdout_file"].splitlines()
                   if line.strip() and line not in (candidate.get("stdout_file") or "")]
        if missing:
            differences.append(f"--stdout-file lacks {missing[:3]!r}")
    return differences


def _read(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.exists() else None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Row:
    case: Case
    variant: str
    results: dict[str, dict] = field(default_factory=dict)

    @property
    def differences(self) -> list[str]:
        return compare(self.results["papermill"], self.results["nbddp"])


def run_matrix(cases: tuple[Case, ...], variants: tuple[str, ...], work: Path) -> list[Row]:
    rows = []
    for case in cases:
        for variant in variants:
            row = Row(case, variant)
            for engine in ENGINES:
                row.results[engine] = run_case(case, variant, engine, work / case.id)
            print(f"{case.id} [{variant}]: {'parity' if not row.differences else '; '.join(row.differences)}",
                  file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def markdown(rows: list[Row]) -> str:
    def seen(result: dict) -> str:
        failed = [c for c in result.get("cells", []) if c["status"] == "failed"]
        cell = f"cell {failed[0]['index']} {failed[0]['ename'] or ''}".strip() if failed else "—"
        return f"exit {result['exit']}, {result['exception'] or 'no exception'}, {cell}"

    same = sum(not r.differences for r in rows)
    intended = sum(bool(r.differences) and r.variant == "ddp" and bool(r.case.intended) for r in rows)
    lines = [f"{same} of {len(rows)} cases behave the same on both engines; {intended} differ by design.", "",
             "| case | notebook | arguments | variant | papermill's engine | nbddp's engine | same? |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        args = " ".join(row.case.args) + (f" (Ctrl-C after {row.case.interrupt_after:g} s)" if row.case.interrupt_after
                                          else "") + (" output `-`" if row.case.output == "-" else "")
        diff = "yes" if not row.differences else "no: " + "; ".join(row.differences).replace("|", "\\|")
        if row.differences and row.variant == "ddp" and row.case.intended:
            diff = f"no, by design: {row.case.intended}"
        lines.append(f"| {row.case.id} | {row.case.notebook} | `{args.strip() or '—'}` | {row.variant} | "
                     f"{seen(row.results['papermill'])} | {seen(row.results['nbddp'])} | {diff} |")
    return "\n".join(lines) + "\n"


def _versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{name} {version(name)}" for name in ("papermill", "nbclient", "nbddp"))


#: What papermill's own engine did, recorded (``--record``) with the versions of what decides it, one record per set
#: of versions: read back in place of running papermill's engine again while those versions are the ones installed.
#: What depends on where they are installed is left out of the results (:func:`_plain`), so a record travels.
REFERENCE = NOTEBOOKS / "reference.json"
#: The packages whose versions decide what papermill's own engine does (nbddp is not among them). IPython's names a
#: line of its own in the warning ``sys.exit`` prints.
REFERENCE_PACKAGES = ("papermill", "nbclient", "nbformat", "jupyter_client", "ipykernel", "ipython")


def reference_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"python": "%d.%d" % sys.version_info[:2], **{name: version(name) for name in REFERENCE_PACKAGES}}


def _records() -> list[dict]:
    try:
        return json.loads(REFERENCE.read_text())["records"]
    except (OSError, ValueError, KeyError):
        return []


def recorded(case: Case, variant: str) -> dict | None:
    """papermill's own engine's result for ``case``, as recorded with the installed versions (``None``: not
    recorded, or recorded with other versions only: run it)."""
    versions = reference_versions()
    for kept in _records():
        if kept.get("versions") == versions:
            return kept["results"].get(f"{case.id}/{variant}")
    return None


def record(cases: tuple[Case, ...], variants: tuple[str, ...], work: Path) -> None:
    """Run papermill's own engine on every case and write its results into :data:`REFERENCE`, as the record of the
    installed versions (keeping the other cases that record holds, and the records of other versions)."""
    versions = reference_versions()
    others = [kept for kept in _records() if kept.get("versions") != versions]
    results = next((kept["results"] for kept in _records() if kept.get("versions") == versions), {})
    for case in cases:
        for variant in variants:
            result = run_case(case, variant, "papermill", work / case.id)
            results[f"{case.id}/{variant}"] = {k: v for k, v in result.items() if k not in ("seconds", "stderr_tail")}
            print(f"{case.id} [{variant}]: exit {result['exit']}, {result['exception'] or 'no exception'}",
                  file=sys.stderr, flush=True)
    records = sorted([*others, {"versions": versions, "results": results}], key=lambda kept: json.dumps(kept["versions"]))
    REFERENCE.write_text(json.dumps({"records": records}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="case ids")
    parser.add_argument("--variants", nargs="*", default=["published", "ddp"])
    parser.add_argument("--markdown", type=Path, default=None,
                        help="write the table into this document (between its parity markers)")
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    parser.add_argument("--record", action="store_true",
                        help=f"run papermill's own engine on every case and record it ({REFERENCE.name}), for the tests")
    args = parser.parse_args(argv)
    cases = tuple(c for c in CASES if args.only is None or c.id in args.only)
    work = Path(tempfile.mkdtemp(prefix="nbddp-parity-"))
    if args.record:
        try:
            record(cases, tuple(args.variants), work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return 0
    started = time.monotonic()
    try:
        rows = run_matrix(cases, tuple(args.variants), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = markdown(rows)
    print(table)
    print(f"{len(rows)} cases in {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.markdown:
        from benchmarks.document import replace_block

        replace_block(args.markdown, "parity", f"Measured {time.strftime('%Y-%m-%d')} ({_versions()}), "
                                               f"{len(rows)} cases in {time.monotonic() - started:.0f} s:\n\n{table}")
    if args.json:
        args.json.write_text(json.dumps([{"case": r.case.id, "variant": r.variant, **r.results} for r in rows], indent=1))
    return 0 if all(not r.differences or (r.variant == "ddp" and r.case.intended) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
