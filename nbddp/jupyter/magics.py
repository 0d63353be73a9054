"""``%load_ext nbddp`` → ``%%ddp_train``: argument parsing and display only.

The work is in :mod:`nbddp.cell_job`; this module records which ``#| ddp``
cells the kernel executed (IPython's ``pre_run_cell`` event carries the cell
id the front end sent) and turns the magic's line into options.
"""

from __future__ import annotations

from pathlib import Path

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from nbddp.cell_job import CellHistory, CellJobOptions, build_script, run_cell_job
from nbddp.errors import NbddpError
from nbddp.compat import apply_catalyst_shims


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

    @magic_arguments()
    @argument("--gpus", default=None, help="GPUs to use: N or all (default: all visible)")
    @argument("--cpu", action="store_true", help="CPU processes with gloo, even with GPUs")
    @argument("--nproc", type=int, default=None, help="CPU processes (default 2)")
    @argument("--engine", choices=("torch", "catalyst"), default=None, help="DDP engine (default: detected)")
    @argument("--return", dest="returns", default="model", help="variables whose trained state comes back")
    @argument("--run-dir", default=None, help="where the script, logs and weights go")
    @argument("--timeout", type=float, default=None, help="stop after this many seconds")
    @argument("--collective-timeout", type=float, default=300.0, help="seconds a rank may wait in a collective")
    @argument("--idle-timeout", type=float, default=None, help="stop when no rank prints or logs for this long")
    @argument("--dry-run", action="store_true", help="show the generated script; launch nothing")
    @cell_magic
    def ddp_train(self, line: str, cell: str):
        """Train this cell across the GPUs (or CPU processes) with DDP; weights come back here."""
        args = parse_argstring(self.ddp_train, line)
        options = CellJobOptions(
            engine=args.engine, returns=tuple(n.strip() for n in args.returns.split(",") if n.strip()),
            gpus=args.gpus, cpu=args.cpu, nproc=args.nproc,
            run_dir=Path(args.run_dir) if args.run_dir else None, timeout=args.timeout, dry_run=args.dry_run,
            collective_timeout=args.collective_timeout, idle_timeout=args.idle_timeout,
        )
        script, parameters = build_script(self.history, cell, self.shell.user_ns, options,
                                          self.shell.execution_count)
        if options.dry_run:
            print(script.text)
            return None
        from nbddp.devices import resolve
        from nbddp.jupyter.view import make_view

        view = make_view(resolve(options.gpus, options.cpu, options.nproc).nproc)
        status = "failed"
        try:
            result = run_cell_job(script, parameters, options, self.shell.user_ns, [view])
            status = "succeeded"
        except KeyboardInterrupt:
            status = "interrupted"
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
