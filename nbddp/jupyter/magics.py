"""``%load_ext nbddp`` → ``%%ddp_train``: argument parsing and display only.

The work is in :mod:`nbddp.cell_job`; this module records which ``#| ddp``
cells the kernel executed (IPython's ``pre_run_cell`` event carries the cell
id the front end sent) and turns the magic's line into options.
"""

from __future__ import annotations


from IPython.core.magic import Magics, cell_magic, magics_class
from nbddp.cell_job import CellHistory, build_script, run_cell_job
from nbddp.compat import apply_catalyst_shims
from nbddp.errors import NbddpError
from nbddp.options import ArgumentParser, add_launch_arguments, launch_options, parse_line
from nbddp.outcome import Status


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="%%ddp_train", description="Train the cell with DDP; the weights come back here.")
    add_launch_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="show the generated script; launch nothing")
    return parser


_PARSER = _parser()


@magics_class
class DdpMagics(Magics):
    def __init__(self, shell) -> None:  # noqa: ANN001
        super().__init__(shell)
        self.history = CellHistory()
        shell.events.register("pre_run_cell", self._record)

    def _record(self, info) -> None:  # noqa: ANN001 - IPython's ExecutionInfo
        tags = ()
        kernel = getattr(self.shell, "kernel", None)
        if kernel is not None:  # tags, when the front end reports them with the request
            try:
                tags = tuple(kernel.get_parent().get("metadata", {}).get("tags", ()) or ())
            except Exception:  # noqa: BLE001 - a front end's odd metadata must never break a cell
                tags = ()
        self.history.record(info.raw_cell, getattr(info, "cell_id", None), tags, self.shell.execution_count)

    @cell_magic
    def ddp_train(self, line: str, cell: str):
        """Train this cell across the GPUs (or CPU processes) with DDP; weights come back here.

        Options are those of ``nbddp run`` (``%%ddp_train --help`` lists them), plus ``--dry-run``.
        """
        args = parse_line(_PARSER, line)
        if args is None:  # --help
            return None
        options = launch_options(args)
        script, parameters = build_script(self.history, cell, self.shell.user_ns, options,
                                          self.shell.execution_count)
        if args.dry_run:
            print(script.text)
            return None
        from nbddp.jupyter.view import make_view
        from nbddp.launchers import devices_for

        view = make_view(devices_for(options).nproc)
        status = Status.FAILED
        try:
            result = run_cell_job(script, parameters, options, self.shell.user_ns, [view],
                                  command=f"%%ddp_train {line}".strip())
            status = Status.SUCCEEDED
        except KeyboardInterrupt:
            status = Status.INTERRUPTED
            raise
        except NbddpError as exc:
            status = getattr(exc, "status", type(exc).__name__)
            raise
        finally:
            view.close(status)
        print(result.summary())
        return None


def load_ipython_extension(ipython) -> None:  # noqa: ANN001
    apply_catalyst_shims()  # Catalyst cells run in this kernel too (single process)
    ipython.register_magics(DdpMagics(ipython))
