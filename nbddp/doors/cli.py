"""``nbddp``: the command line, a thin shell over the core.

argparse turns argv into frozen option objects; the work happens in
:mod:`nbddp.notebook.script` and :mod:`nbddp.doors.notebook_run`. Nothing imported here at module
level imports torch, so ``nbddp --help`` answers at once.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from nbddp._version import __version__
from nbddp.doors.doctor import add_doctor_arguments
from nbddp.doors.jupyter.kernelspec import add_kernel_commands
from nbddp.doors.signals import signals_interrupt
from nbddp.contracts.errors import NbddpError, SignalReceived, UsageError
from nbddp.contracts.owned import NotYours
from nbddp.contracts.status import BatchState, Status
from nbddp.plan.option_fields import add_arguments, values_from
from nbddp.plan.options import (BATCH, EXPORT, RUN, SWEEP, SweepOptions, add_detach_argument, add_launch_arguments,
                                launch_options)

if TYPE_CHECKING:
    from nbddp.contracts.rundir import RunDir
    from nbddp.doors.batch.schedule import Batch
    from nbddp.doors.notebook_run import RunOptions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nbddp",
        description="Distributed PyTorch training (DDP) from Jupyter notebooks.",
        epilog="Tag cells 'parameters', 'ddp' (setup, runs in every rank) and 'ddp-train' "
        "(the training), or start them with '#| ddp' / '#| ddp-train'. With no cell marked, the cell that "
        "calls notebook_launcher(...), trainer.fit(...) or trainer.train() trains, and the cells it needs are its "
        "setup.",
    )
    parser.add_argument("--version", action="version", version=f"nbddp {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    export = commands.add_parser("export", help="write the DDP training script of a notebook")
    export.add_argument("notebook", type=Path, help="the .ipynb file")
    export.add_argument("-o", "--output", default=None,
                        help="script path (default: NOTEBOOK with .py); '-' prints it")
    export.add_argument("--keep-markdown", action="store_true", help="keep markdown cells as comments")
    add_launch_arguments(export, EXPORT)
    export.set_defaults(handler=_export)

    run = commands.add_parser("run", help="run a notebook with its training cells as a DDP job")
    run.add_argument("notebook", type=Path, help="the .ipynb file")
    run.add_argument("-o", "--output", type=Path, default=None,
                     help="executed notebook (default: RUN_DIR/output.ipynb)")
    add_launch_arguments(run, RUN)
    add_detach_argument(run)
    run.add_argument("--debug-on-failure", action="store_true",
                     help="a rank that raises opens a debugger (pdb) in its failing frame, here in this terminal, "
                          "before it ends; the other ranks wait meanwhile")
    _add_raw_output(run)
    run.set_defaults(handler=_run)

    batch = commands.add_parser("batch", help="run the notebook once per parameter set of a grid")
    batch.add_argument("notebook", type=Path, help="the .ipynb file (with a 'parameters' cell)")
    batch.add_argument("--grid", required=True, type=Path,
                       help="a YAML/JSON file, or the grid itself ('{\"lr\": [0.1, 0.2]}'): name -> list of values "
                            "(all combinations), or a list of mappings")
    add_launch_arguments(batch, BATCH)
    add_arguments(batch, SweepOptions, BATCH, (SWEEP,))
    batch.set_defaults(handler=_batch)

    tune = commands.add_parser("tune", help="search hyperparameters: an Optuna study, every trial a run of the "
                                            "training cells on the same warm ranks")
    tune.add_argument("notebook", type=Path, help="the .ipynb file (with a 'parameters' cell)")
    _add_tune_arguments(tune)
    add_launch_arguments(tune, RUN)
    tune.set_defaults(handler=_tune)

    doctor = commands.add_parser("doctor", help="what stops distributed training on this machine: each check in "
                                                "seconds, a problem in one line with its fix")
    add_doctor_arguments(doctor)
    doctor.set_defaults(handler=_doctor)

    kernel = commands.add_parser("kernel", help="the nbddp kernel: a Jupyter kernel that starts the warm ranks' "
                                                "starter as it starts (install, remove)",
                                 description="The nbddp kernel: ipykernel's Python kernel, which starts the warm "
                                             "ranks' starter (torch imported, no GPU touched) as the kernel starts, "
                                             "ahead of the notebook's first cells (docs/warm-ranks.md).")
    add_kernel_commands(kernel)
    kernel.set_defaults(handler=_kernel)

    attach = commands.add_parser("attach", help="follow a detached run (--detach) again, until it ends")
    attach.add_argument("run", metavar="RUN", help="its run dir (or its name, from nbddp ps)")
    _add_raw_output(attach)
    attach.set_defaults(handler=_attach)

    ps = commands.add_parser("ps", help="list the runs alive now")
    ps.set_defaults(handler=_ps)
    kill = commands.add_parser("kill", help="stop a live run and every process of it")
    kill.add_argument("runs", nargs="+", metavar="RUN",
                      help="run dir name or path (from nbddp ps), or its process group")
    kill.set_defaults(handler=_kill)
    return parser


def _add_tune_arguments(tune: argparse.ArgumentParser) -> None:
    from nbddp.doors.tune.space import FORMS

    study = tune.add_argument_group("study")
    study.add_argument("--trials", type=int, required=True, metavar="N", help="trials in the study (a resumed study: "
                       "in all, those done before included)")
    study.add_argument("--metric", action="append", required=True, metavar="NAME",
                       help="the value rank 0 logs with nbddp.log(NAME=v, step=s) that the study optimises (its last "
                            "value); repeat for several objectives")
    study.add_argument("--space", action="append", default=[], metavar="NAME=DIST(...)",
                       help=f"a parameter and where to search it, once per parameter; DIST: {', '.join(FORMS)}")
    study.add_argument("--direction", action="append", default=None, choices=("minimize", "maximize"),
                       help="minimize (default) or maximize; one, or one per --metric")
    study.add_argument("--pruner", default="median", choices=("median", "hyperband", "none"),
                       help="Optuna's pruner, which stops a trial whose metric is worse than the others' at the same "
                            "step (default median)")
    study.add_argument("--storage", default=None, metavar="URL",
                       help="keep the study in this database (sqlite:///study.db): run the same command again to "
                            "resume it")
    study.add_argument("--study-name", default=None, metavar="NAME",
                       help="the study's name (default: the notebook's stem with --storage, else with the time)")
    study.add_argument("--seed", type=int, default=None, help="the sampler's seed (the same trials again)")
    study.add_argument("--gpus-per-trial", type=int, default=None, metavar="K",
                       help="GPUs per trial: G/K trials at once on this machine's G GPUs, each on warm ranks of its "
                            "own (pinned with CUDA_VISIBLE_DEVICES, as nbddp batch --gpus-per-run)")
    study.add_argument("--parallel", type=int, default=None, metavar="J",
                       help="trials at once (on CPU: each with --nproc processes; with GPUs: at most J slots)")
    study.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # (a concurrent study's worker process)


def _add_raw_output(command: argparse.ArgumentParser) -> None:
    command.add_argument("--raw-output", action="store_true",
                         help="pass the ranks' output to this terminal as it is, escape sequences too (by default "
                              "colours and \\r pass, other control characters are shown escaped)")


def _shown(text: str, args: argparse.Namespace | None = None) -> str:
    """What this terminal shows of ``text`` (a rank's, an error's message): :func:`terminal_safe`'s, unless the command
    was given ``--raw-output``."""
    from nbddp.display.terminal import terminal_safe

    return text if getattr(args, "raw_output", False) else terminal_safe(text)


def _export(args: argparse.Namespace) -> int:
    from nbddp.notebook.reader import read_notebook
    from nbddp.contracts.rundir import SCRIPT_NAME
    from nbddp.notebook.script import generate, write_script

    from nbddp.launchers import export_launch

    to_stdout = args.output == "-"
    target = None if to_stdout else Path(args.output or args.notebook.with_suffix(".py"))
    if "nnodes" in args and "node_rank" not in args:
        args.node_rank = 0  # the header gives the command of every node
    wanted = launch_options(args)
    script_name = SCRIPT_NAME if target is None else target.name
    notebook = read_notebook(args.notebook)
    plan = export_launch(wanted, notebook, script_name)
    if plan.sbatch is not None and to_stdout:
        raise UsageError("--slurm writes train.sbatch beside the script: give -o PATH instead of -o -.")
    options = wanted.export_options(engine=plan.engine, keep_markdown=args.keep_markdown, script_name=script_name,
                                    launch_hint=plan.hint, script_dir=Path.cwd() if target is None else target.parent)
    script = generate(notebook, options)
    if script.note:
        print(f"nbddp: {script.note}", file=sys.stderr)  # (also in the script's header)
    for notice in script.notices:
        print(f"nbddp: {notice}", file=sys.stderr)
    if to_stdout:
        sys.stdout.write(script.text)
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    path, map_path = write_script(script, target)
    print(f"wrote {path} ({script.engine} engine) and its source map {map_path.name}", file=sys.stderr)
    if plan.sbatch is not None:
        sbatch = path.with_suffix(".sbatch")
        sbatch.write_text(plan.sbatch, encoding="utf-8")
        sbatch.chmod(0o755)
        print(f"wrote {sbatch}: submit it with `sbatch {sbatch.name}` from {path.parent}", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace) -> int:
    from nbddp.doors.notebook_run import RunOptions, run_notebook

    from nbddp.job.debugger import Console

    if args.detach and args.debug_on_failure:
        raise UsageError("--debug-on-failure opens the debugger in this terminal, which a detached run has left: "
                         "drop one of them")
    # A breakpoint() opens where someone can type: a terminal, or the input --debug-on-failure was given.
    console = Console() if sys.stdin is not None and (sys.stdin.isatty() or args.debug_on_failure) else None
    options = RunOptions(args.notebook, launch_options(args), args.output, command=_command(),
                         console=None if args.detach else console, debug_on_failure=args.debug_on_failure,
                         raw_output=args.raw_output)
    if args.detach:
        return _run_detached(options)
    with signals_interrupt():
        return run_notebook(options).exit_code


def _run_detached(options: RunOptions) -> int:
    """Check what can be checked here, hand the run to a supervisor, then follow it as ``nbddp attach`` does."""
    import dataclasses

    from nbddp.doors import detached
    from nbddp.doors.notebook_run import check_notebook
    from nbddp.contracts.rundir import create_run_dir

    check_notebook(options)
    run_dir = create_run_dir(options.notebook, options.launch.run_dir,
                             lambda text: print(_shown(f"nbddp: {text}"), file=sys.stderr))
    options = dataclasses.replace(options, launch=dataclasses.replace(options.launch, run_dir=run_dir.path),
                                  owner="detached")
    pid = detached.start(options, run_dir, Path.cwd())
    print(f"nbddp: detached (supervisor pid {pid}): closing this terminal leaves the run going; "
          f"`nbddp attach {run_dir}` follows it again, `nbddp kill {run_dir}` stops it", file=sys.stderr, flush=True)
    return _follow(run_dir, options.raw_output)


def _attach(args: argparse.Namespace) -> int:
    from nbddp.doors import detached

    return _follow(detached.find_run(args.run, Path.cwd()), args.raw_output)


def _follow(run_dir: RunDir, raw: bool = False) -> int:
    """What the run's terminal shows (the supervisor's transcript, as the ranks wrote it), from its first line until it
    ends; its exit code. ``raw``: control sequences pass as they are (:func:`_shown`).

    Ctrl-C (or SIGTERM, SIGHUP: a closed terminal) stops the following only, never the run."""
    from nbddp.display.terminal import stdout_write, terminal_safe
    from nbddp.doors import detached

    try:
        with signals_interrupt():
            record = detached.replay(run_dir, stdout_write if raw else lambda text: stdout_write(terminal_safe(text)))
    except (KeyboardInterrupt, SignalReceived):
        print(f"\nnbddp: stopped following; {detached.how_to_return(run_dir, in_kernel=False)}", file=sys.stderr)
        return 0
    return record.exit_code


def _batch(args: argparse.Namespace) -> int:
    from nbddp.doors.batch.schedule import BatchOptions, run_batch

    options = BatchOptions(args.notebook, args.grid, launch_options(args), **values_from(SweepOptions, args))
    try:
        with signals_interrupt():
            rows, code = run_batch(options, progress=_BatchProgress())
    except KeyboardInterrupt:
        print("\nnbddp: batch interrupted; every running run was stopped. Resume with --resume.", file=sys.stderr)
        return Status.INTERRUPTED.exit_code
    except SignalReceived as exc:
        print(f"\nnbddp: batch stopped by {signal.Signals(exc.signum).name}. Resume with --resume.", file=sys.stderr)
        return Status.INTERRUPTED.code(exc.signum)
    failed = sum(r["status"] != Status.SUCCEEDED for r in rows)
    for row in rows:
        if row["status"] != Status.SUCCEEDED:
            print(_shown(f"nbddp: {row['run']} {row['status']}: {row['error']}"), file=sys.stderr)
    print(f"nbddp: {len(rows) - failed}/{len(rows)} runs succeeded; "
          f"summary in {Path(rows[0]['run_dir']).parent}/summary.md" if rows else "nbddp: no runs", file=sys.stderr)
    return code


def _tune(args: argparse.Namespace) -> int:
    from nbddp.doors.tune.study import TuneOptions, run_tune

    options = TuneOptions(args.notebook, launch_options(args), args.trials, tuple(args.metric), tuple(args.space),
                          tuple(args.direction or ("minimize",)), args.pruner, args.storage, args.study_name,
                          args.seed, command=_command(), gpus_per_trial=args.gpus_per_trial, parallel=args.parallel,
                          worker=args.worker)
    try:
        with signals_interrupt():
            return run_tune(options, say=lambda text: print(_shown(text), file=sys.stderr, flush=True)).exit_code
    except (KeyboardInterrupt, SignalReceived) as exc:
        from nbddp.contracts.errors import stop_signal

        signum = getattr(exc, "signum", None) or stop_signal(exc)  # (a trial's: the signal that stopped its job)
        print(f"\nnbddp: study stopped by {signal.Signals(signum).name} (a running trial's job was stopped)"
              + ("; run the same command again to resume it" if options.storage else ""), file=sys.stderr)
        return Status.INTERRUPTED.code(signum)


class _BatchProgress:
    """tqdm's bar over the batch's runs (on a terminal; one line per finished run otherwise)."""

    def __init__(self) -> None:
        self.bar = None
        self.done = 0

    def __call__(self, batch: Batch) -> None:
        from tqdm import tqdm

        states = batch.states
        finished = [s for s in states if s.status.finished]
        failed = sum(not s.status.ok for s in finished)
        if self.bar is None:
            self.bar = tqdm(total=len(states), unit="run", file=sys.stderr, dynamic_ncols=True,
                            disable=not sys.stderr.isatty())
        running = [s.run.name for s in states if s.status == BatchState.RUNNING]
        self.bar.set_postfix_str(f"{failed} failed; running {', '.join(running) or 'none'}", refresh=False)
        self.bar.update(len(finished) - self.bar.n)
        if self.bar.disable and len(finished) != self.done:
            print(f"{len(finished)}/{len(states)} runs done, {failed} failed", file=sys.stderr, flush=True)
        self.done = len(finished)
        if len(finished) == len(states):
            self.bar.close()


def _doctor(args: argparse.Namespace) -> int:
    from nbddp.doors.doctor import run_doctor

    try:
        report = run_doctor(args, lambda line: print(_shown(line)))  # (a process's name is anyone's to choose)
    except KeyboardInterrupt:
        print("nbddp doctor: interrupted; its checks were stopped", file=sys.stderr)
        return Status.INTERRUPTED.exit_code
    return 0 if report.passed else 1


def _kernel(args: argparse.Namespace) -> int:
    from nbddp.doors.jupyter.kernelspec import kernel_command

    return kernel_command(args, lambda line: print(_shown(line), file=sys.stderr))


def _ps(args: argparse.Namespace) -> int:
    import time

    from nbddp.job.registry import live_runs

    runs = live_runs()
    if not runs:
        print("no live runs")
        return 0
    print(f"{'RUN':<40} {'AGE':>7} {'ENGINE':<9} {'WORLD':>5} {'OWNER':<14} RUN DIR")
    for run in runs:
        age = time.time() - run.started
        print(_shown(f"{run.name:<40} {age:>6.0f}s {run.engine:<9} {run.world_size:>5} "
                     f"{run.owner + ' ' + str(run.owner_pid):<14} {run.run_dir}"))
    return 0


def _kill(args: argparse.Namespace) -> int:
    from nbddp.job.registry import find, kill

    code = 0
    for which in args.runs:
        try:
            run = find(which)
        except UsageError:
            if not _stop_detached(which):
                raise
            continue
        if kill(run):
            print(f"stopped {run.name}")
        else:
            print(f"nbddp: error: {run.name} still has processes after SIGKILL", file=sys.stderr)
            code = 1
    return code


def _stop_detached(which: str) -> bool:
    """A detached run whose job isn't registered (yet): its supervisor is stopped; False if ``which`` is none."""
    from nbddp.doors import detached

    try:
        run_dir = detached.find_run(which, Path.cwd())
    except NotYours:
        raise  # another user's run: say whose, not "no live run"
    except UsageError:
        return False
    if not detached.supervisor_alive(run_dir):
        return False
    if detached.stop(run_dir):
        print(f"stopped {run_dir.path.name}")
        return True
    raise NbddpError(f"the supervisor of {run_dir.path.name} did not stop; see {run_dir.supervisor_log}")


def _command() -> str:
    """How this process was started, for ``result.json``."""
    from nbddp.plan.options import format_argv

    return format_argv(["nbddp", *sys.argv[1:]])


def main(argv: Sequence[str] | None = None) -> int:
    _skip_slow_iri_format_checks()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, with its usage (the top-level one knows no options)
        _commands(parser)[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.handler(args)
    except NbddpError as exc:
        print(_shown(f"nbddp: error: {exc}", args), file=sys.stderr)
        return exc.exit_code


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, by name."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _skip_slow_iri_format_checks() -> None:
    """Keep ``jsonschema`` from importing ``rfc3987_syntax`` in this process: 1.4 s here, on every start.

    nbformat validates notebooks with jsonschema, whose format checkers import every backend
    they find; ``rfc3987_syntax`` (pulled in by ``jsonschema[format-nongpl]``) builds ~35 Lark
    parsers at import time, for the ``iri`` formats no notebook schema uses
    (python-jsonschema/jsonschema#1428). Only the command's own process is changed (never a
    kernel or a program that imports nbddp); where the module is already imported, nothing is.
    """
    sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]  # None: "not installed"


if __name__ == "__main__":
    sys.exit(main())
