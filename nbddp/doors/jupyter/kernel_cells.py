"""The script of a ``%%ddp_train`` cell, made from the cells this kernel ran.

The script is made of the ``#| ddp`` cells this kernel has executed (the latest version of each,
tracked by the cell id the front end sends) and the body of the ``%%ddp_train`` cell. It never
reads the notebook file, which may be unsaved. Names the code uses but doesn't define come from
the kernel when they are plain data (papermill's injected parameters, values computed in untagged
cells); anything else is refused before launch.

Nothing here imports IPython or ipywidgets (:mod:`nbddp.doors.jupyter.magics` is the shell).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Hashable, Sequence

from nbddp.contracts.errors import CellError, ParameterError
from nbddp.notebook.cells import SETUP, TRAIN, TRAIN_MAGIC, ExportedCell, cell_role, export_cell
from nbddp.contracts.freevars import free_names
from nbddp.notebook.literals import is_plain_data
from nbddp.notebook.parameters import type_notices
from nbddp.notebook.reader import Cell
from nbddp.notebook.script import Script, indent_code, render
from nbddp.plan.options import LaunchOptions

TRAIN_LABEL = "the %%ddp_train cell"


class CellHistory:
    """The ``#| ddp`` cells executed in this kernel, latest version of each, in first-run order.

    Cells are tracked by the id the front end sends with each execution
    (JupyterLab, Notebook 7, VS Code do). Without ids, executions are kept in
    execution order, an unchanged re-run replacing its earlier copy.
    """

    def __init__(self) -> None:
        self._cells: dict[Hashable, Cell] = {}

    def record(self, source: str, cell_id: str | None = None, tags: Sequence[str] = (),
               execution_count: int | None = None) -> None:
        count = execution_count or 0
        cell = Cell(count, "code", source, tuple(tags), cell_id, label=f"In [{count}]")
        key: Hashable = ("id", cell_id) if cell_id else ("source", source)
        try:
            role = cell_role(cell, "the kernel")
        except CellError:
            role = None  # the magic reports bad directives when it exports
        if role == SETUP:
            self._cells[key] = cell  # an existing key keeps its place, with the new source
        else:
            self._cells.pop(key, None)  # a cell edited to no longer be `#| ddp` leaves the script

    def cells(self) -> list[Cell]:
        return list(self._cells.values())


def build_script(history: CellHistory, body: str, namespace: dict[str, Any], options: LaunchOptions,
                 execution_count: int | None = None, label: str = TRAIN_LABEL,
                 only_ranks: tuple[int, ...] | None = None, returns: tuple[str, ...] | None = None,
                 ) -> tuple[Script, dict[str, Any]]:
    """The script for one ``%%ddp_train`` cell (or ``%%ddp_exec`` cell: ``label``, ``only_ranks`` that run its body,
    ``returns=()``), and the plain values written into it.

    Those values are the names the code uses but no ``#| ddp`` cell defines: taken from the kernel
    (papermill's injected parameters, values from untagged cells), or from ``-p NAME VALUE``, which
    overrides the kernel's value of such a name.

    Raises:
        CellError: a syntax error or unexportable IPython syntax (naming ``In [N]``
            and the line), or a free name whose kernel value can't reach the ranks.
        ParameterError: a ``-p`` name the training code doesn't take from the kernel.
    """
    origin = "the kernel"
    exported = [export_cell(cell, SETUP, origin) for cell in history.cells()]
    # With its magic line, as the notebook shows the cell: its lines are counted as the editor counts them.
    train = Cell(execution_count or 0, "code", f"%%{TRAIN_MAGIC}\n{body}", (), None, label=label)
    exported.append(_for_ranks(export_cell(train, TRAIN, origin), only_ranks))
    export = options.export_options(parameters={}, parameters_source="values in the kernel",
                                    **({} if returns is None else {"returns": returns}))
    first = render(exported, origin, export)
    free = free_names(first.text)
    unknown = sorted(set(options.parameters) - set(free))
    if unknown:
        raise ParameterError(
            f"-p {', '.join(unknown)}: the training code takes no such value from the kernel"
            + (f"; it takes {', '.join(free)}." if free else " (it defines everything it uses in '#| ddp' cells)."))
    # -p's values against the kernel's, as a notebook's parameters cell's defaults are (every door says the same)
    notices = type_notices({name: namespace.get(name) for name in options.parameters}, options.parameters,
                           "the kernel's")
    values = {name: options.parameters[name] if name in options.parameters else _kernel_value(name, namespace)
              for name in free}
    if not values:
        return replace(first, notices=notices), values
    script = render(exported, origin, replace(export, parameters=values))
    return replace(script, notices=notices), values


def _for_ranks(cell: ExportedCell, ranks: tuple[int, ...] | None) -> ExportedCell:
    """``cell`` run by ``ranks`` only (``None``: every rank): its body under a test of the rank, written on the magic's
    own line, so that every line of the body keeps its number in the cell."""
    if ranks is None or not any(line.strip() and not line.lstrip().startswith("#") for line in cell.code.split("\n")):
        return cell  # (every rank, or nothing to run)
    test = f"if __import__('torch.distributed', fromlist=['get_rank']).get_rank() in {tuple(ranks)!r}:"
    body = "\n".join(indent_code(cell.code, "    "))  # (a multi-line string's lines keep their value)
    return replace(cell, code=f"{test}\n{body}", first_line=cell.first_line - 1)


def _kernel_value(name: str, namespace: dict[str, Any]) -> Any:
    if name in namespace and is_plain_data(namespace[name]):
        return namespace[name]
    if name in namespace:
        raise CellError(
            f"{name!r} is a {type(namespace[name]).__name__} in the kernel; the ranks only receive plain "
            f"values (numbers, strings, lists, dicts…). Move the code that defines {name!r} into a "
            "'#| ddp' cell (so every rank builds it too) and run that cell again."
        )
    raise CellError(
        f"the training code uses {name!r}, which no '#| ddp' cell run so far defines and the kernel "
        f"doesn't have. Define it in a '#| ddp' cell and run that cell first."
    )
