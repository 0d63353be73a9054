"""``papermill --engine nbddp NOTEBOOK OUT -p NAME VALUE``: papermill runs the notebook the nbddp way.

Registered through papermill's ``papermill.engine`` entry point, so anything that drives papermill
(Airflow's PapermillOperator, Dagster, Ploomber) gets DDP with no change. Papermill parameterizes
the notebook as usual (its ``injected-parameters`` cell reaches every rank); this engine then runs
it exactly as ``nbddp run`` does — the ``ddp-train`` cells as a DDP job, every other cell in a
kernel — and hands papermill the executed cells with papermill's own cell bookkeeping, so its
output notebook, ``PapermillExecutionError`` and exit status are what papermill users expect.

Launch options come from ``NBDDP_OPTIONS`` (the flags of ``nbddp run``, e.g. ``--cpu --nproc 2``),
since papermill's command line has no place for them. The kernel runs in papermill's working
folder (``--cwd``), where the run dir goes too.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from papermill.engines import Engine

OPTIONS_VARIABLE = "NBDDP_OPTIONS"


class NbddpEngine(Engine):
    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name: str, **kwargs: Any) -> None:  # noqa: ANN001
        from nbddp.notebook.reader import from_nbformat
        from nbddp.options import ArgumentParser, add_launch_arguments, launch_options
        from nbddp.doors.notebook_run import RunOptions, run_notebook

        parser = ArgumentParser(prog=f"${OPTIONS_VARIABLE}")
        add_launch_arguments(parser)
        launch = launch_options(parser.parse_args(shlex.split(os.environ.get(OPTIONS_VARIABLE, ""))))
        name = Path(kwargs.get("input_path") or "notebook.ipynb").name
        path = Path.cwd() / name
        notebook = from_nbformat(nb_man.nb, path)
        result = run_notebook(RunOptions(path, launch, command=f"papermill --engine nbddp {name}"),
                              notebook=notebook, say=_say)
        copy_outputs(nb_man, result.executed)


def copy_outputs(nb_man, executed) -> None:  # noqa: ANN001
    """Give papermill the executed cells, with its per-cell start/complete/exception bookkeeping.

    Cells after the first error never ran: papermill leaves them pending, as it does itself.
    """
    for index, cell in enumerate(nb_man.nb.cells):
        if cell.cell_type != "code":
            continue
        ran = executed.cells[index]
        nb_man.cell_start(cell, index)
        cell.outputs = ran.get("outputs", [])
        cell.execution_count = ran.get("execution_count")
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        if errors:
            nb_man.cell_exception(cell, index)
            nb_man.cell_complete(cell, index)
            return
        nb_man.cell_complete(cell, index)


def _say(text: str) -> None:
    from papermill.log import logger

    for line in text.splitlines():
        logger.info(line)
