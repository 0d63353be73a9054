"""Script line → notebook cell and line, stored beside the generated script.

The script is a plain file whose lines are the cells' lines (indented under the
``__main__`` guard, never reflowed), so a traceback from *any* source — the
rank's own stderr, torchrun's error file, Catalyst's spawn wrapper — names a
``train.py`` line that this map turns back into ``cell N, line L``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Segment:
    """Script lines ``script_start``…``script_start + length - 1`` are cell lines from ``cell_line`` on."""

    script_start: int
    length: int
    cell: int | None
    """Cell number, or ``None`` for code nbddp wrote (command-line parameters)."""
    cell_line: int
    role: str
    label: str | None = None
    """Set for cells named otherwise than ``cell N`` (``In [5]``, ``the %%ddp_train cell``)."""


@dataclass(frozen=True)
class SourceMap:
    notebook: str
    script: str
    segments: tuple[Segment, ...]

    def lookup(self, script_line: int) -> tuple[int, int, str] | None:
        """``(cell, line within cell, role)`` for a script line, or ``None`` if nbddp wrote it."""
        for seg in self.segments:
            if seg.script_start <= script_line < seg.script_start + seg.length and seg.cell is not None:
                return seg.cell, seg.cell_line + script_line - seg.script_start, seg.role
        return None

    def where(self, script_line: int) -> str | None:
        """``nb.ipynb, cell 3, line 5`` (or ``In [5], line 2``) for a script line; ``None`` if nbddp wrote it."""
        for seg in self.segments:
            if seg.script_start <= script_line < seg.script_start + seg.length and seg.cell is not None:
                line = seg.cell_line + script_line - seg.script_start
                return f"{seg.label}, line {line}" if seg.label else f"{self.notebook}, cell {seg.cell}, line {line}"
        return None

    def to_json(self) -> str:
        data = {"notebook": self.notebook, "script": self.script,
                "segments": [asdict(s) for s in self.segments]}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "SourceMap":
        data = json.loads(text)
        return cls(data["notebook"], data["script"], tuple(Segment(**s) for s in data["segments"]))

    @classmethod
    def load(cls, path: str | Path) -> "SourceMap":
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    @classmethod
    def beside(cls, script: str | Path | None) -> "SourceMap | None":
        """The map beside ``script`` (``train.py.map.json``), or ``None``: no script, or no readable map there (moved
        away, a script not nbddp's)."""
        try:
            return cls.load(sourcemap_path(script)) if script else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def translate_traceback(self, text: str) -> str:
        """Append ``[notebook cell N, line L]`` to every traceback frame line in the script."""
        name = re.escape(Path(self.script).name)
        frame = re.compile(r'(File "(?:[^"]*/)?' + name + r'", line (\d+))')

        def annotate(match: re.Match) -> str:
            where = self.where(int(match.group(2)))
            return match.group(1) + (f" [{where}]" if where else "")

        return frame.sub(annotate, text)


def sourcemap_path(script_path: str | Path) -> Path:
    """Where the map of ``train.py`` lives: ``train.py.map.json`` beside it."""
    script_path = Path(script_path)
    return script_path.with_name(script_path.name + ".map.json")
