"""``%load_ext nbddp`` → ``%%ddp_train`` (and ``%%ddp_exec``, ``%ddp_debug``, ``%ddp_ranks``, ``%ddp_attach``,
``%ddp_doctor``):
argument parsing and display only.

The run is :func:`nbddp.job.orchestrator.run`'s, with this kernel's namespace receiving the weights;
this module records which ``#| ddp`` cells the kernel executed (IPython's ``post_run_cell`` event
carries the cell id the front end sent), turns the magic's line into options and shows the run. A
``%%ddp_exec`` cell is a run too, on the warm ranks the last ``%%ddp_train`` used, with its options, whose
script's training part is the cell and which brings nothing back: the warm ranks' kept setup is its namespace,
and their putting it back after every job undoes what it changed. A rank's debugger (``%ddp_debug``'s post-mortem, a
``breakpoint()`` in a run) is relayed through the cell's input box (:func:`kernel_console`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from nbddp.display.ending import NO_WEIGHTS, Ending, first_line, weights_went
from nbddp.doors.jupyter.kernel_cells import CellHistory, build_script
from nbddp.doors.jupyter.kernel_pool import kernel_pool
from nbddp.doors.jupyter.session import session_notebook
from nbddp.doors.doctor import add_doctor_arguments, run_doctor
from nbddp.contracts.errors import UsageError
from nbddp.job import orchestrator
from nbddp.job.debugger import Console, post_mortem
from nbddp.job.outcome import gist
from nbddp.contracts.metrics import last_metrics
from nbddp.contracts.rank_env import DEFAULT_WARM_IDLE
from nbddp.contracts.rank_memory import read_peaks
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.status import Status
from nbddp.launchers import why_not_warm
from nbddp.plan.options import (MAGIC, ArgumentParser, LaunchOptions, add_detach_argument, add_launch_arguments,
                                check_seconds, launch_options, parse_line)

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionResult, InteractiveShell

    from nbddp.job.follow import Event
    from nbddp.job.lifecycle import Job


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="%%ddp_train", description="Train the cell with DDP; the weights come back here.")
    add_launch_arguments(parser, MAGIC)
    parser.add_argument("--dry-run", action="store_true", help="show the generated script; launch nothing")
    parser.add_argument("--fresh", action="store_true",
                        help="start fresh ranks for this run instead of the kernel's warm ones "
                             "(%%ddp_ranks shows them)")
    add_detach_argument(parser)
    parser.add_argument("--attach", nargs="?", const="", default=None, metavar="RUN",
                        help="follow a detached run instead of starting one: RUN's run dir, or this notebook's latest; "
                             "its weights come back here when it ends")
    return parser


_PARSER = _parser()


def launch_of(line: str) -> LaunchOptions:
    """The launch options a ``%%ddp_train`` line asks for.

    Raises:
        UsageError: a line ``%%ddp_train`` refuses.
    """
    args = parse_line(_PARSER, line)
    if args is None:
        raise UsageError("%%ddp_train --help has no run to repeat")
    return launch_options(args)


def _ranks_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="%ddp_ranks", description="The kernel's warm ranks: show them and the setup each "
                            "keeps, drop that setup (forget), stop or restart them, or prepare them before the first "
                            "run (start: %load_ext nbddp does).")
    parser.add_argument("action", nargs="?", choices=("show", "start", "forget", "stop", "restart"), default="show")
    parser.add_argument("--idle", type=float, metavar="SECONDS",
                        help=f"idle ranks exit after this long without a run (default {DEFAULT_WARM_IDLE:g})")
    return parser


_RANKS_PARSER = _ranks_parser()


def _attach_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="%ddp_attach", description="Follow a detached run (--detach) until it ends; "
                            "its weights come back here as a normal run's do.")
    parser.add_argument("run", nargs="?", default="", metavar="RUN",
                        help="its run dir, or its name under runs/ (default: this notebook's latest detached run)")
    return parser


_ATTACH_PARSER = _attach_parser()


def _doctor_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="%ddp_doctor", description="What stops distributed training on this machine: each "
                            "check in seconds, a problem in one line with its fix (as nbddp doctor; the GPU memory "
                            "this kernel holds is named as its own).")
    add_doctor_arguments(parser)
    return parser


_DOCTOR_PARSER = _doctor_parser()


def _exec_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="%%ddp_exec", description="Run the cell on the kernel's warm ranks, in the state "
                            "they keep after setup; every rank's output comes labelled. What it changes there is "
                            "undone before the next %%ddp_train.")
    parser.add_argument("--ranks", metavar="R[,R...]", default=None,
                        help="only these ranks run it (default: every rank; a collective needs every rank)")
    parser.add_argument("--keep", action="store_true",
                        help="keep what it changes: the cell joins the setup cells that every later %%%%ddp_train "
                             "runs first, warm or fresh")
    return parser


_EXEC_PARSER = _exec_parser()


def _debug_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="%ddp_debug", description="A debugger (pdb) in the frame where the last %%ddp_train "
                            "failed on the warm ranks, in the rank that failed first.")
    parser.add_argument("--rank", type=int, default=None, metavar="N", help="that rank's failure instead")
    return parser


_DEBUG_PARSER = _debug_parser()
#: What %ddp_debug says when no rank keeps a failure.
NO_FAILURE = ("%ddp_debug: no warm rank keeps a failure: it opens after a %%ddp_train that failed on the kernel's "
              "warm ranks, until the next run (a --fresh or detached run's ranks are gone: nbddp run "
              "--debug-on-failure opens one as the rank fails)")
#: What %%ddp_exec says where there are no warm ranks to run on.
NO_WARM_RANKS = ("%%ddp_exec runs on the kernel's warm ranks, and there are none now: run a %%ddp_train cell first "
                 "(its ranks stay warm; %ddp_ranks shows them)")
#: What a %%ddp_exec cell is called in its tracebacks and script.
EXEC_LABEL = "the %%ddp_exec cell"


@magics_class
class DdpMagics(Magics):
    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)
        self.history = CellHistory()
        self.said: set[str] = set()
        """What this kernel's cells were told of the machine (said once per kernel)."""
        self.last_train: tuple[str, str] | None = None
        """The last ``%%ddp_train`` cell this kernel ran: its line and its body (``nbddp.objective``'s trials)."""
        shell.events.register("post_run_cell", self._record)

    def _record(self, result: ExecutionResult | None) -> None:
        """Remember a cell the kernel ran, by the ``In [N]`` the front end shows for it: the result's count.
        (Not the shell's count in ``pre_run_cell``: IPython 9 counts the cell before that event, 8 after.)"""
        if result is None:
            return
        info = result.info
        tags = ()
        kernel = getattr(self.shell, "kernel", None)
        if kernel is not None:  # tags, when the front end reports them with the request
            try:
                tags = tuple(kernel.get_parent().get("metadata", {}).get("tags", ()) or ())
            except Exception:  # noqa: BLE001 - a front end's odd metadata must never break a cell
                tags = ()
        self.history.record(info.raw_cell, getattr(info, "cell_id", None), tags, result.execution_count)

    @line_magic
    def ddp_ranks(self, line: str) -> None:
        """Show (``%ddp_ranks``: the ranks, and what each keeps of the setup), ``forget`` (drop the kept setup),
        ``stop`` or ``restart`` the kernel's warm ranks; ``--idle SECONDS`` sets how long idle ranks wait for
        the next ``%%ddp_train`` before exiting."""
        args = parse_line(_RANKS_PARSER, line)
        if args is None:
            return None
        if args.idle is not None:
            check_seconds(args.idle, "--idle")
            kernel_pool.set_idle(args.idle)
        if args.action == "forget":
            print(f"[nbddp] {kernel_pool.forget()}")
            return None
        if args.action == "start":
            print(f"[nbddp] {kernel_pool.prepare() or kernel_pool.describe()}")
            return None
        if args.action in ("stop", "restart"):
            said = ["stopped the warm ranks" if kernel_pool.stop() else "no warm ranks to stop"]
            if args.action == "restart":
                said.append(kernel_pool.prepare() or "the next %%ddp_train starts fresh ones")
            print(f"[nbddp] {'; '.join(said)}")
            return None
        print(f"[nbddp] {kernel_pool.describe()}")
        return None

    @line_cell_magic
    def ddp_train(self, line: str, cell: str | None = None) -> None:
        """Train this cell across the GPUs (or CPU processes) with DDP; weights come back here.

        Options are those of ``nbddp run`` (``%%ddp_train --help`` lists them), plus ``--dry-run``
        and ``--fresh``.
        """
        args = parse_line(_PARSER, line)
        if args is None:  # --help
            return None
        if args.attach is not None:
            if args.detach or args.dry_run:
                raise UsageError("%%ddp_train --attach follows a run that is already going: "
                                 "drop --detach and --dry-run.")
            return self._attach(args.attach)
        if not (cell or "").strip():
            raise UsageError("%%ddp_train: the cell has no training code: put it under the %%ddp_train line.")
        options = launch_options(args)
        script, parameters = build_script(self.history, cell, self.shell.user_ns, options,
                                          self.shell.execution_count)
        self.last_train = (line, cell)
        if args.dry_run:
            print(script.text)
            return None
        cwd = Path.cwd()
        request = orchestrator.RunRequest(
            script, options, session_notebook(cwd, self.shell.user_ns), cwd, parameters,
            {k: v for k, v in parameters.items() if k in options.parameters}, f"%%ddp_train {line}".strip(),
            source="the kernel", owner="kernel", warm=None if args.fresh else kernel_pool,
            console=kernel_console(self.shell), said=self.said)
        if args.fresh or args.detach or why_not_warm(script.engine, options):
            freed = kernel_pool.make_room()  # ranks of its own on the same devices: the warm ones' GPU memory is theirs
            if freed:
                print(f"[nbddp] {freed}")
        if args.detach:
            return self._detach(request)
        return self._train(request)

    @line_cell_magic
    def ddp_exec(self, line: str, cell: str | None = None) -> None:
        """Run this cell on the kernel's warm ranks (``--ranks 0,1``: those only), in the namespace they keep after
        the setup cells; each rank's output comes labelled. What it changes is undone before the next run (the
        warm ranks' fresh-run state), unless ``--keep``: then the cell joins the setup every later run runs."""
        from dataclasses import replace

        args = parse_line(_EXEC_PARSER, line)
        if args is None:  # --help
            return None
        if not (cell or "").strip():
            raise UsageError("%%ddp_exec: the cell is empty: put the code for the ranks under the %%ddp_exec line.")
        pool, launch = kernel_pool.live(), kernel_pool.launch
        if pool is None or launch is None:
            raise UsageError(NO_WARM_RANKS)
        if args.keep and args.ranks is not None:
            raise UsageError("%%ddp_exec --keep --ranks: a kept cell is a setup cell, which every rank runs; "
                             "keep it without --ranks")
        ranks = _ranks(args.ranks, pool.devices.nproc)
        launch = replace(launch, run_dir=None, parameters={}, track=())  # (the run's own: its dir, its values)
        script, parameters = build_script(self.history, cell, self.shell.user_ns, launch, self.shell.execution_count,
                                          label=EXEC_LABEL, only_ranks=ranks, returns=())
        script = replace(script, returns_note="%%ddp_exec brings nothing back")
        cwd = Path.cwd()
        request = orchestrator.RunRequest(
            script, launch, session_notebook(cwd, self.shell.user_ns), cwd, parameters, {},
            f"%%ddp_exec {line}".strip(), source="the kernel", owner="kernel", warm=kernel_pool,
            console=kernel_console(self.shell), tracked=False,  # (a look at the ranks: no experiment record's…)
            said=self.said)
        self._train(request)
        if args.keep:  # (a setup cell of this kernel's, as a '#| ddp' cell run now would be)
            self.history.record(f"#| ddp\n{cell}", None, (), self.shell.execution_count)
            print("[nbddp] kept: the cell is a setup cell of every later %%ddp_train now")
        return None

    @line_magic
    def ddp_debug(self, line: str) -> None:
        """Open a debugger (pdb) in the frame where the last ``%%ddp_train`` failed on the warm ranks, in the rank
        that failed first (``--rank N``: that rank's), as IPython's ``%debug`` does in the kernel. Each rank keeps
        its failure until the next run; ``q`` leaves the debugger."""
        args = parse_line(_DEBUG_PARSER, line)
        if args is None:
            return None
        console = kernel_console(self.shell)
        if console is None:
            raise UsageError("%ddp_debug needs a front end that answers input() (JupyterLab, Notebook, VS Code); "
                             "this one doesn't (papermill, nbclient): nbddp run --debug-on-failure opens it in a "
                             "terminal")
        pool = kernel_pool.live()
        failures = pool.failures() if pool is not None and not pool.busy() else {}
        if not failures:
            raise UsageError(NO_FAILURE)
        rank = next(iter(failures)) if args.rank is None else args.rank
        if rank not in failures:
            raise UsageError(f"%ddp_debug --rank {rank}: rank {rank} keeps no failure of the last run; "
                             f"rank(s) {', '.join(map(str, failures))} do")
        failure = failures[rank]
        first = " (the first to fail)" if rank == next(iter(failures)) else ""
        print(f"[nbddp] rank {rank}{first}: {failure.get('type')}: {gist(str(failure.get('message')))}")
        post_mortem(pool, rank, console)
        return None

    @line_magic
    def ddp_doctor(self, line: str) -> None:
        """Check what stops distributed training here (``nbddp doctor``'s checks, with its options): one line each.
        The GPU memory this kernel holds is said as its own (CUDA initialised in the notebook's process)."""
        import os

        args = parse_line(_DOCTOR_PARSER, line)
        if args is None:
            return None
        try:
            run_doctor(args, print, own_pid=os.getpid(), ours=kernel_pool.held_gpus())
        except KeyboardInterrupt:
            print("[nbddp] the doctor was interrupted; its checks were stopped")
        return None

    @line_magic
    def ddp_attach(self, line: str) -> None:
        """Follow a detached run (``%%ddp_train --detach``, ``nbddp run --detach``) until it ends, with the live
        view; its weights come back into this kernel as a normal run's do. Stopping the cell leaves the run going."""
        args = parse_line(_ATTACH_PARSER, line)
        return None if args is None else self._attach(args.run)

    def _detach(self, request: orchestrator.RunRequest) -> None:
        """Hand the run to a supervisor (its own ranks: warm ones would die with this kernel), then follow it."""
        from dataclasses import replace

        from nbddp.doors import detached
        from nbddp.contracts.rundir import create_run_dir
        from nbddp.job import trackers
        from nbddp.launchers import devices_for

        devices_for(request.launch, asked=request.script.processes)  # refused here, not by the supervisor
        run_dir = create_run_dir(request.notebook, request.launch.run_dir, lambda text: print(f"[nbddp] {text}"))
        records, names = trackers.open_records()  # (the supervisor is not this kernel: it can't read them)
        if names:
            print(f"[nbddp] {trackers.start_line(names)}")
        request = replace(request, launch=replace(request.launch, run_dir=run_dir.path), owner="detached", warm=None,
                          said=None,  # (the supervisor's lines go to the run's transcript, every one)
                          console=None,  # (nobody types into a detached run's ranks: its breakpoints are skipped)
                          kernel_records=trackers.public(records))  # (written into the run dir: no credentials)
        pid = detached.start(request, run_dir, request.cwd)
        print(f"[nbddp] detached (supervisor pid {pid}): restarting this kernel or closing the notebook leaves the "
              f"run going; %ddp_attach {run_dir} follows it again, `nbddp kill {run_dir}` stops it")
        return self._attach(str(run_dir))

    def _attach(self, which: str) -> None:
        """Follow a detached run with the live view; load its weights here when it ends (as ``_train`` does)."""
        from nbddp.doors import detached

        cwd = Path.cwd()
        run_dir = detached.find_run(which, cwd) if which else detached.latest(session_notebook(cwd, self.shell.user_ns))
        started = time.monotonic()
        shown = _Shown(self.shell)

        try:
            record = detached.follow(run_dir, [shown], shown.heartbeat, lambda ranks: shown.open(ranks, run_dir.path))
        except KeyboardInterrupt:
            again = detached.how_to_return(run_dir, in_kernel=True)
            shown.close(Ending("detached", time.monotonic() - started, run_dir.path, "", again), say=True)
            return None
        except BaseException as exc:
            shown.close(Ending(Status.FAILED, time.monotonic() - started, run_dir.path, NO_WEIGHTS,
                               first_line(str(exc))))
            raise
        weights = NO_WEIGHTS
        weights_file = run_dir.weights
        if record.status == Status.SUCCEEDED and weights_file.exists():
            loaded = orchestrator.InProcess(self.shell.user_ns).load(weights_file)
            if loaded.error is not None:
                shown.close(detached.ending(record, run_dir, first_line(loaded.message)))
                raise loaded.error
            weights = weights_went(loaded)
        shown.close(detached.ending(record, run_dir, weights), say=True)
        if record.status != Status.SUCCEEDED:
            detached.raise_judged(run_dir, record)
        return None

    def _train(self, request: orchestrator.RunRequest) -> None:
        """Run the job with its live view; end with one line, or an error without nbddp's frames."""
        started = time.monotonic()
        shown = _Shown(self.shell)
        paths: RunDir | None = None
        nodes = request.launch.nodes
        kernel = orchestrator.NoKernel("node 0 holds the weights") if nodes and nodes.rank != 0 \
            else orchestrator.InProcess(self.shell.user_ns)

        def on_start(job: Job) -> None:
            nonlocal paths
            paths = job.paths
            shown.open(job.local_ranks(), job.run_dir)

        def end(status: str, reason: str = "", weights: str = NO_WEIGHTS, metrics: dict | None = None) -> None:
            metrics = metrics if metrics is not None else (last_metrics(paths) if paths else {})
            shown.close(Ending(status, time.monotonic() - started, paths.path if paths else None, weights, reason,
                               metrics, read_peaks(paths) if paths else {}, paths.dropped_output() if paths else {}))

        try:
            result = orchestrator.run(request, kernel, [shown], lambda text: print(f"[nbddp] {text}"),
                                      on_start=on_start, heartbeat=shown.heartbeat)
        except BaseException as exc:  # nbddp itself broke: say so, then raise
            end(Status.FAILED, first_line(f"{type(exc).__name__}: {exc}"))
            raise
        if result.interrupted_by is not None:
            shutting_down = getattr(self.shell, "exit_now", False)
            end(Status.INTERRUPTED, "the kernel is restarting or shutting down" if shutting_down
                else "every rank stopped")
            raise _short_interrupt(time.monotonic() - started, paths.path if paths else None) from None
        if not result.succeeded:
            end(result.status, first_line(result.message))
            result.raise_for_status()
        end(Status.SUCCEEDED, weights=weights_went(result.kernel), metrics=result.record.final_metrics)
        return None


def kernel_console(shell: InteractiveShell) -> Console | None:
    """The cell's input box, where its front end answers ``input()`` (JupyterLab, Notebook, VS Code; papermill and
    nbclient don't: ``None``, and breakpoints are skipped); IPython in a terminal reads the terminal."""
    kernel = getattr(shell, "kernel", None)
    return None if kernel is not None and not getattr(kernel, "_allow_stdin", False) else Console()


def _ranks(text: str | None, size: int) -> tuple[int, ...] | None:
    """``--ranks 0,2`` → ``(0, 2)``; ``None``: every rank.

    Raises:
        UsageError: a rank the warm ranks don't have.
    """
    if text is None:
        return None
    try:
        ranks = tuple(sorted({int(word) for word in text.split(",") if word.strip()}))
    except ValueError:
        raise UsageError(f"--ranks {text!r}: give rank numbers, e.g. --ranks 0,1") from None
    wrong = [rank for rank in ranks if not 0 <= rank < size]
    if not ranks or wrong:
        raise UsageError(f"--ranks {text}: the warm ranks are 0 to {size - 1}")
    return ranks


class _Shown:
    """The cell's live view (made once the job's ranks are known), what a run and an attached run show alike."""

    def __init__(self, shell: InteractiveShell) -> None:
        self.shell = shell
        self.view = None

    def open(self, ranks: Sequence[int], run_dir: Path) -> None:
        from nbddp.doors.jupyter.view import make_view

        self.view = make_view(ranks, run_dir)

    def __call__(self, event: Event) -> None:  # (a sink)
        if self.view is not None:
            self.view(event)

    def heartbeat(self) -> None:
        if self.view is not None:
            self.view.tick()
        if getattr(self.shell, "exit_now", False):  # ipykernel's shutdown_request: a restart or shutdown
            raise KeyboardInterrupt("the kernel is shutting down")

    def close(self, ending: Ending, say: bool = False) -> None:
        """Leave the ending in the view's place (``say``: printed when there was no view)."""
        if self.view is None:
            if say:
                print(f"[nbddp] {ending.line()}")
            return
        try:
            self.view.close(ending)
        except Exception as exc:  # noqa: BLE001 - the view must never hide how the run ended
            print(f"[nbddp] {ending.line()} (the view could not show it: {type(exc).__name__}: {exc})")


def _short_interrupt(seconds: float, run_dir: Path | None) -> KeyboardInterrupt:
    """A KeyboardInterrupt that IPython shows as one short message, not nbddp's stack and the cell's source."""
    where = f" Its logs: {run_dir}" if run_dir else ""
    exc = KeyboardInterrupt(f"the run was interrupted after {seconds:.1f}s; every rank has stopped.{where}")
    exc._render_traceback_ = lambda: [f"\x1b[0;31mKeyboardInterrupt\x1b[0m: {exc}"]  # IPython looks for it
    return exc


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """Register the magics (``nbddp.load_ipython_extension`` has prepared the warm ranks first)."""
    ipython.register_magics(DdpMagics(ipython))
    cleanup = ipython.input_transformer_manager.cleanup_transforms
    if _bodiless_cell_magic not in cleanup:
        cleanup.append(_bodiless_cell_magic)


def _bodiless_cell_magic(lines: list[str]) -> list[str]:
    """``%%ddp_train --help`` (``%%ddp_exec --help``) alone in a cell runs as the line magic ``%ddp_train --help``.

    IPython refuses a cell magic without a body before the magic is called ("the cell body is
    empty"); as a line magic the same line reaches :meth:`DdpMagics.ddp_train`, which prints the help
    (or says the cell has no training code)."""
    code = [line for line in lines if line.strip()]
    for magic in ("%%ddp_train", "%%ddp_exec"):
        if len(code) == 1 and code[0].lstrip().startswith(magic):
            return [code[0].replace(magic, magic[1:], 1)]
    return lines
