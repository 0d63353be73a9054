"""``nbddp``: the command line, a thin shell over the core.

argparse turns argv into frozen option objects; the work happens in
:mod:`nbddp.script` and :mod:`nbddp.run`. Nothing imported here at module
level imports torch, so ``nbddp --help`` answers at once.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Sequence

from nbddp import __version__
from nbddp.errors import NbddpError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nbddp",
        description="Distributed PyTorch training (DDP) from Jupyter notebooks.",
        epilog="Tag cells 'parameters', 'ddp' (setup, runs in every rank) and 'ddp-train' "
        "(the training), or start them with '#| ddp' / '#| ddp-train'.",
    )
    parser.add_argument("--version", action="version", version=f"nbddp {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    export = commands.add_parser("export", help="write the DDP training script of a notebook")
    export.add_argument("notebook", type=Path, help="the .ipynb file")
    export.add_argument("-o", "--output", default=None,
                        help="script path (default: NOTEBOOK with .py); '-' prints it")
    _add_script_options(export)
    export.add_argument("--keep-markdown", action="store_true", help="keep markdown cells as comments")
    export.set_defaults(handler=_export)

    run = commands.add_parser("run", help="run a notebook with its training cells as a DDP job")
    run.add_argument("notebook", type=Path, help="the .ipynb file")
    _add_script_options(run)
    _add_device_options(run)
    run.add_argument("-o", "--output", type=Path, default=None,
                     help="executed notebook (default: RUN_DIR/output.ipynb)")
    run.add_argument("--run-dir", type=Path, default=None,
                     help="where the script, logs and weights go (default: runs/STEM-TIME beside the notebook)")
    run.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="stop the run after this long (exit 124)")
    _add_fault_options(run)
    run.add_argument("--max-restarts", type=int, default=0, metavar="N",
                     help="restart failed ranks up to N times (torch engine); pair with nbddp.save_checkpoint/restore")
    run.set_defaults(handler=_run)

    batch = commands.add_parser("batch", help="run the notebook once per parameter set of a grid")
    batch.add_argument("notebook", type=Path, help="the .ipynb file (with a 'parameters' cell)")
    batch.add_argument("--grid", required=True, type=Path,
                       help="YAML/JSON: name -> list of values (all combinations), or a list of mappings")
    batch.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                       dest="parameters", help="fix a parameter for every run")
    batch.add_argument("--gpus-per-run", type=int, default=None, metavar="K", help="GPUs per run (default 1)")
    batch.add_argument("--cpu", action="store_true", help="CPU processes with gloo")
    batch.add_argument("--nproc", type=int, default=None, help="CPU processes per run (default 2)")
    batch.add_argument("--parallel", type=int, default=None, metavar="J", help="runs at once (CPU default 1)")
    batch.add_argument("--out", type=Path, default=None, help="batch folder (default: batches/STEM-TIME)")
    batch.add_argument("--resume", action="store_true", help="skip runs of --out that already succeeded")
    batch.add_argument("--engine", choices=("torch", "catalyst"), default=None)
    batch.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="per run")
    _add_fault_options(batch)
    batch.set_defaults(handler=_batch)

    ps = commands.add_parser("ps", help="list the runs alive now")
    ps.set_defaults(handler=_ps)
    kill = commands.add_parser("kill", help="stop a live run and every process of it")
    kill.add_argument("runs", nargs="+", metavar="RUN", help="run dir name or path (from nbddp ps), or its process group")
    kill.set_defaults(handler=_kill)
    return parser


def _add_script_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("torch", "catalyst"), default=None,
                        help="DDP engine (default: catalyst if the training cells call runner.train, else torch)")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                        dest="parameters", help="override a parameter (value read as a Python literal, else a string)")
    parser.add_argument("--return", dest="returns", default="model", metavar="NAME[,NAME...]",
                        help="variables whose trained state comes back (default: model)")


def _add_fault_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collective-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="a rank waiting longer than this in a collective fails the run, exit 124 (default 300)")
    parser.add_argument("--idle-timeout", type=float, default=None, metavar="SECONDS",
                        help="stop the run (exit 124) when no rank prints or logs anything for this long")


def _add_device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", default=None, metavar="N|all", help="GPUs to use (default: all visible)")
    parser.add_argument("--cpu", action="store_true", help="run CPU processes with gloo, even with GPUs")
    parser.add_argument("--nproc", type=int, default=None, help="CPU processes (default 2)")


def _export_options(args: argparse.Namespace, script_name: str):
    from nbddp.parameters import parse_pairs
    from nbddp.script import ExportOptions

    return ExportOptions(
        engine=args.engine,
        parameters=parse_pairs(args.parameters),
        returns=tuple(n.strip() for n in args.returns.split(",") if n.strip()),
        keep_markdown=getattr(args, "keep_markdown", False),
        script_name=script_name,
    )


def _export(args: argparse.Namespace) -> int:
    from nbddp.notebook import read_notebook
    from nbddp.script import generate, write_script

    to_stdout = args.output == "-"
    target = None if to_stdout else Path(args.output or args.notebook.with_suffix(".py"))
    options = _export_options(args, "train.py" if target is None else target.name)
    script = generate(read_notebook(args.notebook), options)
    if to_stdout:
        sys.stdout.write(script.text)
        return 0
    path, map_path = write_script(script, target)
    print(f"wrote {path} ({script.engine} engine) and its source map {map_path.name}", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace) -> int:
    from nbddp.run import RunOptions, SignalReceived, run_notebook

    options = RunOptions.from_cli(args, _export_options(args, "train.py"))

    def stop(signum, frame):  # noqa: ANN001 - SIGINT already raises KeyboardInterrupt
        raise SignalReceived(signum)

    # Only the CLI installs handlers (never the kernel): the run stops every rank and exits 128+N.
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return run_notebook(options).exit_code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _batch(args: argparse.Namespace) -> int:
    from nbddp.batches import BatchOptions, run_batch
    from nbddp.parameters import parse_pairs
    from nbddp.run import SignalReceived

    options = BatchOptions(args.notebook, args.grid, parse_pairs(args.parameters), args.gpus_per_run, args.cpu,
                           args.nproc, args.parallel, args.out, args.resume, args.engine, args.timeout,
                           args.collective_timeout, args.idle_timeout)

    def stop(signum, frame):  # noqa: ANN001
        raise SignalReceived(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        rows, code = run_batch(options, progress=_BatchProgress())
    except KeyboardInterrupt:
        print("\nnbddp: batch interrupted; every running run was stopped. Resume with --resume.", file=sys.stderr)
        return 130
    except SignalReceived as exc:
        print(f"\nnbddp: batch stopped by {signal.Signals(exc.signum).name}. Resume with --resume.", file=sys.stderr)
        return 128 + exc.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    failed = sum(r["status"] != "succeeded" for r in rows)
    print(f"nbddp: {len(rows) - failed}/{len(rows)} runs succeeded; summary in {Path(rows[0]['run_dir']).parent}/summary.md"
          if rows else "nbddp: no runs", file=sys.stderr)
    return code


class _BatchProgress:
    """One overall bar plus the running runs: redrawn in a terminal, a line per change otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = ""
        self.drawn = 0

    def __call__(self, batch) -> None:  # noqa: ANN001 - nbddp.batches.Batch
        import time

        states = batch.states
        done = [s for s in states if s.status not in ("pending", "running")]
        failed = [s for s in done if s.status not in ("succeeded", "skipped")]
        width = 30
        filled = int(width * len(done) / max(1, len(states)))
        lines = [f"[{'#' * filled}{'.' * (width - filled)}] {len(done)}/{len(states)} runs done, {len(failed)} failed"]
        for s in states:
            if s.status == "running":
                lines.append(f"  running {s.run.name} ({time.monotonic() - s.started:.0f}s)")
        text = "\n".join(lines)
        if self.tty:
            sys.stderr.write("\x1b[F\x1b[K" * self.drawn + text + "\n")
            self.drawn = len(lines)
        elif text.split("(")[0] != self.last.split("(")[0]:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()
        self.last = text


def _ps(args: argparse.Namespace) -> int:
    import time

    from nbddp.registry import live_runs

    runs = live_runs()
    if not runs:
        print("no live runs")
        return 0
    print(f"{'RUN':<40} {'AGE':>7} {'ENGINE':<9} {'WORLD':>5} {'OWNER':<14} RUN DIR")
    for run in runs:
        age = time.time() - run.started
        print(f"{run.name:<40} {age:>6.0f}s {run.engine:<9} {run.world_size:>5} {run.owner + ' ' + str(run.owner_pid):<14} {run.run_dir}")
    return 0


def _kill(args: argparse.Namespace) -> int:
    from nbddp.registry import find, kill

    code = 0
    for which in args.runs:
        run = find(which)
        if kill(run):
            print(f"stopped {run.name}")
        else:
            print(f"nbddp: error: {run.name} still has processes after SIGKILL", file=sys.stderr)
            code = 1
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except NbddpError as exc:
        print(f"nbddp: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
