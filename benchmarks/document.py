"""Figures written into a document between markers, so that a re-run replaces them and nothing else; and the name of
the CPU they were measured on."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the line that says where figures were measured."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def replace_block(doc: Path, name: str, text: str) -> None:
    """Replace what stands between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in ``doc`` (appended when
    the markers are absent)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    current = doc.read_text(encoding="utf-8") if doc.exists() else ""
    block = f"{begin}\n{text.strip()}\n{end}"
    if begin in current and end in current:
        head, rest = current.split(begin, 1)
        current = head + block + rest.split(end, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(current, encoding="utf-8")
