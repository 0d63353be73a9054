"""MkDocs hooks: the reference pages are written from the code as the site is built, so they can't drift.

A page's marker comment becomes what the code says:

* ``<!-- nbddp:help COMMAND -->``: the help of ``nbddp COMMAND`` (``nbddp`` alone: the top level) or of a magic
  (``%%ddp_train``), as ``--help`` prints it, from the parsers themselves;
* ``<!-- nbddp:options -->``: the launch options' table (:func:`nbddp.plan.options.options_table`).
"""

from __future__ import annotations

import os
import re
from typing import Any

#: argparse wraps help at the terminal's width: the site's is this.
HELP_COLUMNS = "100"
_MARKER = re.compile(r"<!-- nbddp:(help|options)(?: ([^>]*?))? -->")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return _MARKER.sub(lambda found: _generated(found.group(1), (found.group(2) or "").strip()), markdown)


def _generated(kind: str, argument: str) -> str:
    if kind == "options":
        from nbddp.plan.options import options_table

        return options_table()
    return "```text\n" + help_text(argument).rstrip() + "\n```"


def help_text(command: str) -> str:
    """What ``--help`` prints for ``command`` (``nbddp``, ``nbddp run``, ``%%ddp_train``, ``%ddp_ranks``, …)."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        return _parser(command).format_help()
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


def _parser(command: str) -> Any:
    from nbddp.doors.cli import _commands, build_parser

    if command.startswith("%"):
        from nbddp.doors.jupyter import magics

        parsers = {"%%ddp_train": magics._PARSER, "%ddp_ranks": magics._RANKS_PARSER,
                   "%ddp_attach": magics._ATTACH_PARSER, "%%ddp_exec": magics._EXEC_PARSER,
                   "%ddp_debug": magics._DEBUG_PARSER, "%ddp_doctor": magics._DOCTOR_PARSER}
        return parsers[command]
    parser = build_parser()
    for word in command.split()[1:]:  # (nbddp kernel install: a command's own commands)
        parser = _commands(parser)[word]
    return parser
