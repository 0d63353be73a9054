"""What a launch needs, defined once: the options type and the one argument definition.

``nbddp run``, ``nbddp batch`` (for each of its runs) and ``%%ddp_train`` all parse their launch
options with :func:`add_launch_arguments` and turn them into one frozen, validated
:class:`LaunchOptions`, so every option has the same name, default and meaning at every front door
and a bad value is refused the same way everywhere: exit 2 (a :class:`UsageError`) naming the option.
Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Sequence

from nbddp.devices import requested_gpus
from nbddp.engines import ENGINES
from nbddp.errors import UsageError

#: ``--collective-timeout``: long enough for a slow epoch's all-reduce, far below torch's 30 minutes.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
DEFAULT_RETURNS = ("model",)


@dataclass(frozen=True)
class LaunchOptions:
    """One launch, as the user asked for it (devices are resolved against the machine later)."""

    gpus: str | None = None
    """``N`` or ``all``; ``None``: every visible GPU, else the CPU."""
    cpu: bool = False
    nproc: int | None = None
    engine: str | None = None
    """``torch``, ``catalyst``, or ``None`` to detect from the training cells."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """Overrides of the parameters cell (``-p NAME VALUE``)."""
    returns: tuple[str, ...] = DEFAULT_RETURNS
    run_dir: Path | None = None
    timeout: float | None = None
    collective_timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT
    idle_timeout: float | None = None
    max_restarts: int = 0

    def __post_init__(self) -> None:
        from nbddp.parameters import check_name

        if self.nproc is not None and self.nproc < 1:
            raise UsageError(f"--nproc {self.nproc}: need at least 1 process.")
        if self.gpus is not None:
            requested_gpus(self.gpus)
            if self.cpu:
                raise UsageError("--cpu and --gpus contradict each other: choose one.")
            if self.nproc is not None:
                raise UsageError("--nproc counts CPU processes; with GPUs use --gpus N (one process per GPU).")
        if self.engine is not None and self.engine not in ENGINES:
            raise UsageError(f"--engine {self.engine}: choose one of {', '.join(ENGINES)}.")
        if self.collective_timeout == 0:  # "0: torch's own", as on the command line
            object.__setattr__(self, "collective_timeout", None)
        for flag in ("timeout", "collective_timeout", "idle_timeout"):
            value = getattr(self, flag)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise UsageError(f"--{flag.replace('_', '-')} {value:g}: give a positive number of seconds.")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts {self.max_restarts}: give 0 or more.")
        if not self.returns:
            raise UsageError("--return: name at least one variable to bring back.")
        for name in self.returns:
            _as_usage(check_name, name, "--return")
        for name in self.parameters:
            _as_usage(check_name, name, "-p")
        if self.max_restarts and self.engine == "catalyst":
            raise UsageError("--max-restarts needs the torch engine (torchrun restarts ranks; Catalyst's spawn can't).")

    def to_argv(self) -> list[str]:
        """The same options as arguments :func:`add_launch_arguments` parses back (a batch's runs)."""
        argv: list[str] = []
        for flag, value in (("--gpus", self.gpus), ("--nproc", self.nproc), ("--engine", self.engine),
                            ("--run-dir", self.run_dir), ("--timeout", self.timeout),
                            ("--collective-timeout", self.collective_timeout), ("--idle-timeout", self.idle_timeout)):
            if value is not None:
                argv += [flag, str(value)]
        if self.collective_timeout is None:
            argv += ["--collective-timeout", "0"]
        if self.cpu:
            argv.append("--cpu")
        if self.max_restarts:
            argv += ["--max-restarts", str(self.max_restarts)]
        if self.returns != DEFAULT_RETURNS:
            argv += ["--return", ",".join(self.returns)]
        for name, value in self.parameters.items():
            argv += ["-p", name, _value_arg(value)]
        return argv


def _value_arg(value: Any) -> str:
    """``-p`` text that parses back to exactly ``value`` (a string stays a string, never a literal)."""
    from nbddp.parameters import parse_value

    if isinstance(value, str) and parse_value(value) == value and not value.startswith("-"):
        return value
    return repr(value)  # a string that reads as a literal or an option goes quoted


def _as_usage(check, name: str, flag: str) -> None:  # noqa: ANN001
    from nbddp.errors import ParameterError

    try:
        check(name)
    except ParameterError as exc:
        raise UsageError(f"{flag} {name!r}: {exc}") from None


def add_script_arguments(parser: argparse.ArgumentParser) -> None:
    """What shapes the script: the engine, parameter overrides, the variables that come back."""
    job = parser.add_argument_group("training script")
    job.add_argument("--engine", choices=ENGINES, default=None,
                     help="DDP engine (default: catalyst if the training cells call runner.train, else torch)")
    job.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"), dest="parameters",
                     help="override a parameter (value read as a Python literal, else a string)")
    job.add_argument("--return", dest="returns", default=",".join(DEFAULT_RETURNS), metavar="NAME[,NAME...]",
                     help="variables whose trained state comes back (default: model)")


def add_launch_arguments(parser: argparse.ArgumentParser, *, run_dir: bool = True) -> None:
    """Every launch option, for every front door (``run_dir=False`` where a folder of runs is named instead)."""
    add_script_arguments(parser)
    devices = parser.add_argument_group("devices")
    devices.add_argument("--gpus", default=None, metavar="N|all", help="GPUs to use (default: all visible)")
    devices.add_argument("--cpu", action="store_true", help="run CPU processes with gloo, even with GPUs")
    devices.add_argument("--nproc", type=int, default=None, help="CPU processes (default 2)")
    limits = parser.add_argument_group("run")
    if run_dir:
        limits.add_argument("--run-dir", type=Path, default=None,
                            help="where the script, logs and weights go (default: runs/STEM-TIME beside the notebook)")
    limits.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="stop the run after this long (exit 124)")
    limits.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT, metavar="SECONDS",
                        help="a rank waiting longer than this in a collective fails the run, exit 124 "
                             "(default 300; 0: torch's own)")
    limits.add_argument("--idle-timeout", type=float, default=None, metavar="SECONDS",
                        help="stop the run (exit 124) when no rank prints or logs anything for this long")
    limits.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="restart failed ranks up to N times (torch engine); pair with nbddp.save_checkpoint/restore")


def parse_returns(text: str) -> tuple[str, ...]:
    """``--return model,optimizer`` → ``("model", "optimizer")``."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def script_arguments(args: argparse.Namespace) -> tuple[str | None, dict[str, Any], tuple[str, ...]]:
    """``(engine, parameters, returns)`` from what :func:`add_script_arguments` parsed, checked."""
    from nbddp.errors import ParameterError
    from nbddp.parameters import parse_pairs

    try:
        parameters = parse_pairs(args.parameters)
    except ParameterError as exc:
        raise UsageError(f"-p: {exc}") from None
    options = LaunchOptions(engine=args.engine, parameters=parameters, returns=parse_returns(args.returns))  # checks them
    return options.engine, options.parameters, options.returns


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The validated options from what :func:`add_launch_arguments` parsed."""
    engine, parameters, returns = script_arguments(args)
    return LaunchOptions(
        gpus=args.gpus, cpu=args.cpu, nproc=args.nproc, engine=engine, parameters=parameters, returns=returns,
        run_dir=getattr(args, "run_dir", None), timeout=args.timeout,
        collective_timeout=args.collective_timeout, idle_timeout=args.idle_timeout,
        max_restarts=args.max_restarts,
    )


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of exiting (inside a kernel, a magic)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}. See {self.prog} --help.")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:  # --help in a magic
        if message:
            print(message)
        raise UsageError(message or "") if status else _HelpShown()


class _HelpShown(Exception):
    """``--help`` was printed; nothing else to do."""


def parse_line(parser: argparse.ArgumentParser, line: str) -> argparse.Namespace | None:
    """Parse a magic's line with ``parser``; ``None`` when it only asked for ``--help``."""
    try:
        return parser.parse_args(shlex.split(line))
    except _HelpShown:
        return None


def format_argv(argv: Sequence[str]) -> str:
    return shlex.join(str(a) for a in argv)
