"""Every launch option, declared once; the one frozen :class:`LaunchOptions` every front door builds.

Each option is one field below, declared with :func:`option` (an :class:`~nbddp.plan.option_fields.Option`):
its name, type and default are the field's; its flags, help, group, metavar, check and the doors that
take it are in the declaration. ``nbddp run``, ``nbddp batch``, ``nbddp export``, ``%%ddp_train`` and ``NBDDP_OPTIONS``
parse what :func:`add_launch_arguments` derives from it; ``nbddp.run()``'s and ``nbddp.batch()``'s
keywords, :meth:`LaunchOptions.to_argv` (a batch's runs) and the documentation's table
(:func:`options_table`) are derived from it too. So every option has the same name, default and
meaning at every front door, and a bad value is refused the same way everywhere: exit 2 (a
:class:`UsageError`) naming the option. A new option is one new field here.
Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

from nbddp.contracts.devices import CPU_PROCESSES, requested_gpus
from nbddp.engines import DEFAULT_RETURNS, ENGINES, engine_help, shard_refusal, shards, spawns_its_own_ranks
from nbddp.contracts.errors import UsageError
from nbddp.contracts.rank_memory import size
from nbddp.contracts.status import Status
from nbddp.plan.option_fields import (Option, add_arguments, check_fields, declared, markdown_rows, to_argv, usage,
                                      values_from)
from nbddp.contracts.rank_env import DEFAULT_RDZV_TIMEOUT  # (owned there: the ranks fall back on it)

if TYPE_CHECKING:
    from nbddp.notebook.script import ExportOptions

#: ``--nproc`` beyond this many CPU processes per CPU of this machine needs ``--oversubscribe``.
PROCESSES_PER_CPU = 4
#: ``--log-cap``: what each rank's log keeps at most (its start and its last lines).
DEFAULT_LOG_CAP = 100_000_000
#: The longest time limit an option takes: a year, in seconds.
MOST_SECONDS = 365 * 24 * 3600
#: ``--collective-timeout``: long enough for a slow epoch's all-reduce, far below torch's 30 minutes.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
_SLURM_KEY = re.compile(r"[A-Za-z][A-Za-z0-9-]*")
#: Options nbddp writes itself: given with --slurm-arg they would contradict the run's own.
_SLURM_OWN = ("nodes", "ntasks", "ntasks-per-node", "output", "error", "gpus-per-node", "chdir", "wait", "array",
              "export", "requeue", "no-requeue", "test-only", "parsable", "hold", "clusters", "M", "wrap",
              "job-name", "cpus-per-task")
#: Options a job that requeues itself sets (``--no-requeue`` leaves them to the user).
_SLURM_REQUEUE_OWN = ("signal", "open-mode")
#: Addresses that mean "every interface": no node can dial them.
_EVERY_INTERFACE = ("0.0.0.0", "::", "*", "")
#: ``--max-requeues``' default: as submitit's ``max_num_timeout``.
DEFAULT_MAX_REQUEUES = 3
#: ``--ray`` without an address: Ray's own rule, ``RAY_ADDRESS`` else the cluster started on this machine.
RAY_AUTO = "auto"

#: The front doors that take launch options (``nbddp.run()`` takes what ``nbddp run`` takes, ``nbddp.batch()``
#: what ``nbddp batch`` takes).
RUN, BATCH, MAGIC, EXPORT, PAPERMILL = ("nbddp run", "nbddp batch", "%%ddp_train", "nbddp export",
                                        "papermill --engine nbddp")
DOORS = (RUN, BATCH, MAGIC, EXPORT, PAPERMILL)
_EVERY = frozenset(DOORS)
_RUNS = _EVERY - {EXPORT}
"""The doors that start a run (``nbddp export`` writes the script and how to launch it)."""

#: ``--help``'s sections, in order.
GROUPS = (_SCRIPT, _DEVICES, _LIMITS, _NODES, _CLUSTER, _RAY, _SLURM) = (
    "training script", "devices", "run", "several nodes (run the same command on every node)",
    "a cluster's nodes (--slurm or --ray)", "ray (the ranks run on a Ray cluster's workers; the kernel runs here)",
    "slurm (the ranks run as a Slurm job; the kernel runs here)")


def option(*flags: str, doors: frozenset[str] = _EVERY, **declaration: Any) -> Any:
    """A dataclass field declared as the launch option ``flags`` (every door takes it unless ``doors`` says
    otherwise; :class:`~nbddp.plan.option_fields.Option` says what else a declaration may say)."""
    return Option(flags, doors=doors, **declaration).field()


# ---------------------------------------------------------------- what several options share


def _at_least(least: int, says: str) -> Callable[[int, str], None]:
    def check(value: int, flag: str) -> None:
        if value < least:
            raise UsageError(f"{flag} {value}: {says}.")
    return check


def check_seconds(value: float, flag: str) -> None:
    """A time limit: positive, and at most :data:`MOST_SECONDS` (torch turns a collective's limit into a
    ``timedelta`` and C++ milliseconds, which a number like 1e30 overflows inside every rank)."""
    if not (value > 0 and math.isfinite(value)):
        raise UsageError(f"{flag} {value:g}: give a positive number of seconds.")
    if value > MOST_SECONDS:
        raise UsageError(f"{flag} {value:g}: give at most {MOST_SECONDS} seconds (a year).")


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)[bB]?\s*")


def _bytes(value: Any) -> int | None:
    """``--log-cap``'s value: ``100MB``, ``1.5GB``, ``500kB``, a count of bytes (decimal units, as the ending
    line says sizes); ``0`` or ``None``: no cap."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return value or None
    found = _SIZE.fullmatch(str(value))
    if found is None:
        raise UsageError(f"--log-cap {value!r}: give a size such as 100MB, 2GB or 500kB (0: no cap).")
    number, unit = float(found.group(1)), found.group(2).upper()
    return int(number * 1000 ** " KMGT".index(unit or " ")) or None


def _names(names: Sequence[str], flag: str) -> None:
    """Names the script assigns to (``-p``'s, ``--return``'s) must be Python names."""
    from nbddp.contracts.errors import ParameterError
    from nbddp.notebook.literals import check_name

    for name in names:
        try:
            check_name(name)
        except ParameterError as exc:
            raise UsageError(f"{flag} {name!r}: {exc}") from None


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _path(value: Any) -> Path | None:
    return None if value is None else Path(value)


def _gpus(value: str, flag: str) -> None:
    requested_gpus(value)  # (it names --gpus itself: devices.py reads the count)


def _cell_number(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} {value}: cells are numbered from 1, as the notebook shows them.")


def _a_name(value: str, flag: str) -> None:
    if not value.strip() or any(c.isspace() for c in value):
        raise UsageError(f"{flag} {value!r}: give a name without spaces.")


# ---------------------------------------------------------------- several nodes, Slurm, Ray


@dataclass(frozen=True)
class Nodes:
    """One node's part in a multi-node run (``--nnodes/--node-rank/--rdzv-endpoint``, as torchrun's)."""

    count: int = option("--nnodes", group=_NODES, type=int, metavar="N", help="number of nodes", example=("2",),
                        check=_at_least(2, "several nodes means 2 or more (one machine needs no --nnodes)"))
    rank: int = option("--node-rank", group=_NODES, type=int, metavar="R", example=("1",),
                       help="this node's rank, 0 to N-1; node 0 runs the notebook's kernel and gets the weights")
    endpoint: str = option("--rdzv-endpoint", group=_NODES, metavar="HOST:PORT", example=("node0:29500",),
                           help="node 0's address and a free port there (its rendezvous store listens on it)")
    """``HOST:PORT`` of node 0, where the rendezvous store listens."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 <= self.rank < self.count:
            raise UsageError(f"--node-rank {self.rank}: give 0 to {self.count - 1} for --nnodes {self.count}.")
        self.host_port()

    def host_port(self) -> tuple[str, int]:
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--rdzv-endpoint {self.endpoint!r}: give HOST:PORT of node 0 (e.g. node0:29500).")
        if host.strip("[]") in _EVERY_INTERFACE:
            raise UsageError(f"--rdzv-endpoint {self.endpoint}: {host} names every interface, not an address another "
                             "node can dial: give node 0's host name or address on the network the nodes share (its "
                             "store listens there, reachable by whoever can reach that network).")
        return host.strip("[]"), int(port)


def _several_nodes(given: dict[str, Any]) -> Nodes | None:
    """``--nnodes/--node-rank/--rdzv-endpoint``, all three (``--nnodes 1`` alone: this machine)."""
    if given == {"count": 1}:
        return None
    if len(given) < 3:
        together = [usage(d) for d in declared(LaunchOptions) if d.parent is not None and d.parent.option.of is Nodes]
        raise UsageError(f"several nodes need {', '.join(together[:-1])} and {together[-1]} together.")
    return Nodes(**given)


#: A cluster's nodes: ``--nodes`` and ``--gpus-per-node`` mean the same for ``--slurm`` and ``--ray``.
_CLUSTER_NODES = Option(("--nodes",), doors=_EVERY, group=_CLUSTER, default=1, type=int, metavar="N", example=("2",),
                        help="nodes to ask for (default 1)", check=_at_least(1, "need at least 1 node"))
_GPUS_PER_NODE = Option(("--gpus-per-node",), doors=_EVERY, group=_CLUSTER, default=None, type=int, metavar="G",
                        example=("4",),
                        help="GPUs per node (default: Slurm's partition's, else --cpu; on Ray: --cpu)",
                        check=_at_least(1, "need at least 1 (or --cpu --nproc P)"))


def _slurm_time(value: str, flag: str) -> None:
    if not re.fullmatch(r"\d+(-\d+)?(:\d+){0,2}|UNLIMITED|INFINITE", value):
        raise UsageError(f"{flag} {value!r}: give a Slurm time limit (MINUTES, HH:MM:SS or D-HH:MM:SS).")


def _key_values(items: list[str], flag: str) -> tuple[tuple[str, str], ...]:
    """``--slurm-arg KEY=VALUE`` (repeated) → ``((KEY, VALUE), ...)``."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"{flag} {item!r}: give KEY=VALUE (e.g. qos=high).")
        pairs.append((key.strip().lstrip("-"), value))
    return tuple(pairs)


@dataclass(frozen=True)
class SlurmRequest:
    """What a ``--slurm`` run asks the cluster for."""

    nodes: int = _CLUSTER_NODES.field()
    gpus_per_node: int | None = _GPUS_PER_NODE.field()
    partition: str | None = option("--partition", group=_SLURM, default=None, metavar="P", example=("gpu",),
                                   help="the partition to submit to (default: Slurm's)", check=_a_name)
    time: str | None = option("--time", group=_SLURM, default=None, metavar="T", example=("1:00:00",),
                              help="time limit, as sbatch's --time", check=_slurm_time)
    account: str | None = option("--account", group=_SLURM, default=None, metavar="A", example=("lab",),
                                 help="the account the job is charged to (default: yours)", check=_a_name)
    extra: tuple[tuple[str, str], ...] = option(
        "--slurm-arg", group=_SLURM, default=(), action="append", metavar="KEY=VALUE", example=("qos=high",),
        help="any other sbatch option, e.g. qos=high (repeatable)", parse=_key_values,
        coerce=lambda pairs: tuple(tuple(pair) for pair in pairs or ()),
        render=lambda pairs, flag: [word for key, value in pairs for word in (flag, f"{key}={value}")])
    """``--slurm-arg KEY=VALUE``: any other sbatch option, passed on as ``--KEY=VALUE``."""
    requeue: bool | None = option(
        "--requeue", group=_SLURM, default=None, action=argparse.BooleanOptionalAction,
        help="before the time limit and on preemption, stop every rank at its next nbddp.save_checkpoint and "
             "requeue the job, which resumes there (default: on when the training code calls nbddp.save_checkpoint)")
    """``None``: requeue when the training code calls ``nbddp.save_checkpoint``."""
    max_requeues: int = option("--max-requeues", group=_SLURM, default=DEFAULT_MAX_REQUEUES, type=int, metavar="N",
                               example=("5",), check=_at_least(0, "give 0 or more"),
                               help=f"fail instead of a requeue beyond the N-th (default {DEFAULT_MAX_REQUEUES})")
    """How many times the job may be requeued (by itself, or by Slurm) before it fails."""

    def __post_init__(self) -> None:
        check_fields(self)
        for key, value in self.extra:
            if not _SLURM_KEY.fullmatch(key):
                raise UsageError(f"--slurm-arg {key}={value}: KEY is an sbatch option name without dashes "
                                 "(e.g. qos=high).")
            if key in _SLURM_REQUEUE_OWN and self.requeue is not False:
                raise UsageError(f"--slurm-arg {key}=...: a job that requeues itself sets --{key} itself; "
                                 "give --no-requeue to set your own.")
            if key in _SLURM_OWN or key in ("partition", "time", "account"):
                raise UsageError(f"--slurm-arg {key}=...: nbddp sets --{key} itself, or depends on it for the run's job"
                                 + (f"; use nbddp's --{key}." if key in ("nodes", "partition", "time", "account",
                                                                       "gpus-per-node") else "."))
            if "\n" in value or "\r" in value or "\0" in value:
                raise UsageError(f"--slurm-arg {key}: the value can't span lines.")

    def requeues(self, saves_checkpoints: bool) -> bool:
        """Whether the job requeues itself when Slurm signals it: as asked, else when there is a checkpoint
        to resume from."""
        return saves_checkpoints if self.requeue is None else self.requeue


@dataclass(frozen=True)
class RayRequest:
    """What a ``--ray`` run asks the cluster for."""

    address: str = RAY_AUTO
    """``auto``, ``HOST:PORT`` of the head (this machine is one of the cluster's nodes) or ``ray://HOST:PORT``
    (Ray Client, from outside the cluster): what ``--ray ADDRESS`` says."""
    nodes: int = _CLUSTER_NODES.field()
    gpus_per_node: int | None = _GPUS_PER_NODE.field()

    def __post_init__(self) -> None:
        check_fields(self)
        address = self.address
        if address.endswith(".ipynb"):
            raise UsageError(f"--ray {address}: that is a notebook, not a cluster's address. Put the notebook first "
                             "(nbddp run NOTEBOOK --ray), or give the address: --ray HOST:PORT.")
        client = address.startswith("ray://")  # (Ray Client's port defaults to 10001)
        host_port = r"\[?[\w.:-]+\]?" + (r"(:\d{1,5})?" if client else r":\d{1,5}")
        if address != RAY_AUTO and not re.fullmatch(host_port, address.removeprefix("ray://")):
            raise UsageError(f"--ray {address!r}: give the cluster's address (HOST:PORT of its head, "
                             "ray://HOST:PORT for Ray Client), or --ray alone for RAY_ADDRESS, else the cluster "
                             "started on this machine.")

    def where(self) -> str:
        """The cluster, as the user named it."""
        if self.address != RAY_AUTO:
            return f"the Ray cluster at {self.address}"
        given = os.environ.get("RAY_ADDRESS")
        return f"the Ray cluster at {given} (RAY_ADDRESS)" if given else "the Ray cluster started on this machine"


# ---------------------------------------------------------------- the launch options


def _parameters(pairs: list[list[str]], flag: str) -> dict[str, Any]:
    """``-p NAME VALUE`` (repeated) → ``{NAME: value}``, each value read as a Python literal, else a string."""
    from nbddp.contracts.errors import ParameterError
    from nbddp.notebook.literals import parse_pairs

    try:
        return parse_pairs(pairs)
    except ParameterError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _value_arg(value: Any) -> str:
    """``-p`` text that parses back to exactly ``value`` (a string stays a string, never a literal)."""
    from nbddp.notebook.literals import parse_value

    if isinstance(value, str) and parse_value(value) == value and not value.startswith("-"):
        return value
    return repr(value)  # a string that reads as a literal or an option goes quoted


def parse_returns(text: str) -> tuple[str, ...]:
    """``--return model,optimizer`` → ``("model", "optimizer")``."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


#: The experiment trackers ``--track`` names (``NBDDP_TRACK``: the same list, for every run of this environment).
TRACKERS = ("mlflow", "tensorboard", "wandb")
TRACK_VARIABLE = "NBDDP_TRACK"


def parse_trackers(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``--track mlflow,wandb`` (or ``["mlflow", "wandb"]``) → ``("mlflow", "wandb")``: lower case, each once."""
    names = value.split(",") if isinstance(value, str) else list(value or ())
    return tuple(dict.fromkeys(name.strip().lower() for name in names if name.strip()))


def _trackers(names: Sequence[str], flag: str) -> None:
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise UsageError(f"{flag} {','.join(unknown)}: nbddp tracks runs in {', '.join(TRACKERS)} "
                         f"(e.g. {flag} mlflow,tensorboard).")


def asked_trackers(launch: "LaunchOptions") -> tuple[str, ...]:
    """The trackers this run's facts go to though its code may call none: ``--track``, else ``NBDDP_TRACK``.

    Raises:
        UsageError: ``NBDDP_TRACK`` names a tracker nbddp doesn't know.
    """
    if launch.track:
        return launch.track
    names = parse_trackers(os.environ.get(TRACK_VARIABLE, ""))
    _trackers(names, TRACK_VARIABLE)
    return names


def _returned(names: Sequence[str], flag: str) -> None:
    if not names:
        raise UsageError(f"{flag}: name at least one variable to bring back.")
    _names(names, flag)


@dataclass(frozen=True)
class LaunchOptions:
    """One launch, as the user asked for it (devices are resolved against the machine later)."""

    engine: str | None = option(
        "--engine", group=_SCRIPT, default=None, choices=ENGINES, example=("torch",),
        help=engine_help())
    """``None``: detected from the training cells."""
    parameters: dict[str, Any] = option(
        "-p", "--parameter", group=_SCRIPT, default_factory=dict, nargs=2, action="append", metavar=("NAME", "VALUE"),
        example=("lr", "0.5"), help="override a parameter (value read as a Python literal, else a string)",
        parse=_parameters, coerce=lambda values: dict(values or {}), check=_names, accepts="Mapping[str, Any] | None",
        render=lambda values, flag: [word for name, value in values.items()
                                     for word in (flag, name, _value_arg(value))])
    """Overrides of the parameters cell."""
    returns: tuple[str, ...] = option(
        "--return", group=_SCRIPT, default=DEFAULT_RETURNS, metavar="NAME[,NAME...]", example=("model,optimizer",),
        help=f"variables whose trained state comes back (default: {','.join(DEFAULT_RETURNS)})",
        coerce=lambda names: parse_returns(names) if isinstance(names, str) else tuple(names or ()), check=_returned,
        render=lambda names, flag: [flag, ",".join(names)], accepts="Sequence[str] | str")
    shard: bool = option("--shard", group=_SCRIPT, default=False, action="store_true",
                         help="shard models with FSDP2: every nbddp.prepare(model) applies fully_shard instead of DDP "
                              "(torch engine)")
    train_cell: int | None = option(
        "--train-cell", group=_SCRIPT, doors=_EVERY - {MAGIC}, default=None, type=int, metavar="N", example=("5",),
        check=_cell_number,
        help="with no cell marked, cell N is the training cell (one that launches its training through a library "
             "nbddp doesn't read, such as a wrapper of Catalyst's); nbddp still chooses its setup")
    """``None``: the cell that launches a library's training, or the marked ones."""
    gpus: str | None = option("--gpus", group=_DEVICES, default=None, metavar="N|all|free", example=("2",),
                              help="GPUs to use (default: all visible; free: those no other process is using)",
                              coerce=_text, accepts="int | str | None", check=_gpus)
    """``N``, ``all`` or ``free``; ``None``: every visible GPU, else the CPU."""
    cpu: bool = option("--cpu", group=_DEVICES, default=False, action="store_true",
                       help="run CPU processes with gloo, even with GPUs")
    nproc: int | None = option("--nproc", group=_DEVICES, default=None, type=int, example=("3",),
                               help=f"CPU processes (default {CPU_PROCESSES})",
                               check=_at_least(1, "need at least 1 process"))
    wait: bool = option("--wait", group=_DEVICES, doors=frozenset({RUN, MAGIC}), default=False, action="store_true",
                        example=("--gpus", "2"),
                        help="with --gpus N or --gpus free: wait until that many GPUs are free of other processes "
                             "(a shared server), saying what it waits for")
    oversubscribe: bool = option("--oversubscribe", group=_DEVICES, doors=_RUNS, default=False, action="store_true",
                                 help=f"start more CPU processes than {PROCESSES_PER_CPU} per CPU of this machine")
    run_dir: Path | None = option("--run-dir", group=_LIMITS, doors=_RUNS - {BATCH}, default=None, type=Path,
                                  example=("runs/first",), coerce=_path, accepts="str | Path | None",
                                  help="where the script, logs and weights go (default: runs/STEM-TIME beside the "
                                       "notebook)")
    timeout: float | None = option("--timeout", group=_LIMITS, doors=_RUNS, default=None, type=float,
                                   metavar="SECONDS", example=("60.5",), check=check_seconds,
                                   help=f"stop the run after this long (exit {Status.TIMEOUT.exit_code})")
    collective_timeout: float | None = option(
        "--collective-timeout", group=_LIMITS, doors=_RUNS, default=DEFAULT_COLLECTIVE_TIMEOUT, type=float,
        metavar="SECONDS", example=("0",), check=check_seconds, coerce=lambda seconds: seconds or None,
        render=lambda seconds, flag: [flag, "0" if seconds is None else str(seconds)],
        help=f"a rank waiting longer than this in a collective fails the run, exit {Status.TIMEOUT.exit_code} "
             f"(default {DEFAULT_COLLECTIVE_TIMEOUT:g}; 0: torch's own)")
    """``None`` (``0`` on the command line): torch's own."""
    idle_timeout: float | None = option(
        "--idle-timeout", group=_LIMITS, doors=_RUNS, default=None, type=float, metavar="SECONDS", example=("30",),
        check=check_seconds,
        help=f"stop the run (exit {Status.TIMEOUT.exit_code}) when no rank prints or logs anything for this long")
    log_cap: int | None = option(
        "--log-cap", group=_LIMITS, doors=_RUNS, default=DEFAULT_LOG_CAP, metavar="SIZE", example=("2GB",),
        coerce=_bytes, render=lambda cap, flag: [flag, str(cap or 0)], accepts="int | str | None",
        help=f"the most each rank's log keeps: its start and its last lines (default {size(DEFAULT_LOG_CAP)}; "
             "e.g. 500MB, 2GB; 0: no cap)")
    """Bytes; ``None`` (``0`` on the command line): no cap (:mod:`nbddp.rank_side.log_cap`)."""
    track: tuple[str, ...] = option(
        "--track", group=_LIMITS, doors=_RUNS, default=(), metavar="TRACKER[,TRACKER...]",
        example=("mlflow,tensorboard",), coerce=parse_trackers, check=_trackers, accepts="Sequence[str] | str",
        render=lambda names, flag: [flag, ",".join(names)] if names else [],
        help=f"write the run's record (parameters, nbddp.log metrics, weights, how it ended) to these trackers even "
             f"where the code calls none: {', '.join(TRACKERS)} (default: ${TRACK_VARIABLE}; a tracker the code "
             "uses gets them anyway)")
    """The trackers nbddp writes the run to itself (:mod:`nbddp.job.trackers`); ``()``: those the code uses."""
    max_restarts: int = option("--max-restarts", group=_LIMITS, doors=_RUNS, default=0, type=int, metavar="N",
                               example=("2",), check=_at_least(0, "give 0 or more"),
                               help="restart failed ranks up to N times (torch engine); pair with "
                                    "nbddp.save_checkpoint/restore")
    nodes: Nodes | None = option(group=_NODES, default=None, of=Nodes, build=_several_nodes)
    """This node's part in a multi-node run; ``None`` on one machine."""
    rdzv_timeout: float = option(
        "--rdzv-timeout", group=_NODES, default=DEFAULT_RDZV_TIMEOUT, type=float, metavar="SECONDS", example=("30",),
        check=check_seconds,
        help=f"how long nodes wait for each other at the start; with --ray, how long the run waits for the cluster's "
             f"resources (default {DEFAULT_RDZV_TIMEOUT:g})")
    slurm: SlurmRequest | None = option("--slurm", group=_SLURM, default=None, action="store_true", of=SlurmRequest,
                                        help="submit the training as a Slurm job")
    """Run the ranks as a Slurm job; ``None`` runs them here."""
    ray: RayRequest | None = option(
        "--ray", group=_RAY, default=None, nargs="?", const=RAY_AUTO, metavar="ADDRESS", example=("head:6379",),
        of=RayRequest, sets="address",
        help="run the training on a Ray cluster: HOST:PORT of its head, ray://HOST:PORT (Ray Client), or nothing "
             "for RAY_ADDRESS, else the cluster started on this machine")
    """Run the ranks on a Ray cluster's workers; ``None`` runs them here."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.gpus is not None:
            if self.cpu:
                raise UsageError("--cpu and --gpus contradict each other: choose one.")
            if self.nproc is not None:
                raise UsageError("--nproc counts CPU processes; with GPUs use --gpus N (one process per GPU).")
        if self.wait and (self.gpus is None or str(self.gpus).lower() == "all"):
            raise UsageError("--wait waits for free GPUs: give --gpus N (or --gpus free) with it.")
        if self.shard and self.engine is not None and not shards(self.engine):
            raise UsageError(shard_refusal(self.engine))
        if self.nproc is not None and not self.oversubscribe and self.slurm is None and self.ray is None:
            _fits_this_machine(self.nproc)
        if self.max_restarts and spawns_its_own_ranks(self.engine):
            raise UsageError("--max-restarts needs the torch engine or a library's (torchrun restarts their ranks); "
                             "Catalyst's spawn can't.")
        self._check_topology()

    @property
    def cluster_flag(self) -> str | None:
        """``--slurm`` or ``--ray``: the cluster the ranks run on, as the user asked for it (``None``: here)."""
        return "--slurm" if self.slurm is not None else "--ray" if self.ray is not None else None

    def _check_topology(self) -> None:
        """Several nodes, Slurm and Ray: the flags that can't go together, refused before anything starts."""
        if self.slurm is not None and self.ray is not None:
            raise UsageError("--slurm and --ray contradict each other: choose the cluster the ranks run on.")
        if (self.nodes is not None or self.slurm is not None) and self.max_restarts:
            raise UsageError("--max-restarts works on one machine: across nodes a restart would need every node's "
                             "agent to agree (torchrun's static rendezvous can't). Drop --max-restarts.")
        if self.ray is not None and self.max_restarts:
            raise UsageError("--max-restarts: a --ray run isn't restarted (its ranks are Ray actors' processes, not "
                             "torchrun's). Drop --max-restarts, or run on this machine.")
        cluster = self.slurm or self.ray
        if cluster is None:
            return
        if self.nodes is not None:
            raise UsageError(f"{self.cluster_flag} chooses the nodes itself: drop --nnodes/--node-rank/--rdzv-endpoint "
                             "(use --nodes N for the node count).")
        if self.gpus is not None:
            raise UsageError(machine_gpus_refusal("--gpus", self))
        if cluster.gpus_per_node is not None and (self.cpu or self.nproc is not None):
            raise UsageError("--gpus-per-node and --cpu/--nproc contradict each other: choose one.")
        if self.ray is not None and spawns_its_own_ranks(self.engine):
            raise UsageError(ray_refusal(self.engine))

    def export_options(self, **more: Any) -> "ExportOptions":
        """What of these options shapes the script (the engine, parameters, returns, sharding), plus ``more``."""
        from nbddp.notebook.script import ExportOptions

        return ExportOptions(**{"engine": self.engine, "parameters": self.parameters, "returns": self.returns,
                                "shard": self.shard, "train_cell": self.train_cell, **more})

    def to_argv(self) -> list[str]:
        """The same options as arguments :func:`add_launch_arguments` parses back (a batch's runs)."""
        return to_argv(self)


def _fits_this_machine(nproc: int) -> None:
    """``--nproc`` beyond :data:`PROCESSES_PER_CPU` per CPU is a typo or a runaway loop, not a plan: each CPU rank
    is a whole Python process with torch (a few hundred MB), and thousands of them fork until the kernel's
    out-of-memory killer takes the notebook's kernel. Refused before anything starts (``--oversubscribe``
    starts them anyway); a cluster's nodes (``--slurm``, ``--ray``) are not this machine."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    most = cpus * PROCESSES_PER_CPU
    if nproc > most:
        raise UsageError(f"--nproc {nproc}: this machine has {cpus} CPU{'s' if cpus != 1 else ''}, so at most {most} "
                         f"processes ({PROCESSES_PER_CPU} per CPU; each is a Python process with torch). Give --nproc "
                         f"{most} or fewer, or add --oversubscribe to start {nproc} anyway.")


def machine_gpus_refusal(flag: str, launch: LaunchOptions) -> str:
    """Why ``flag``, a count of this machine's GPUs, can't size a run on a cluster's nodes."""
    return f"{flag} counts this machine's GPUs; with {launch.cluster_flag} say --gpus-per-node G."


def ray_refusal(engine: str) -> str:
    """Why an engine that spawns its own ranks can't run on Ray (every rank is a Ray actor's process)."""
    return (f"--ray: the {engine} engine spawns its own ranks from one process (mp.spawn), but on a Ray cluster "
            "each rank is a process of its own Ray actor, placed by Ray. Use the torch engine (--engine torch, with "
            "nbddp.prepare(model)), or run Catalyst here or with --slurm.")


# ---------------------------------------------------------------- the doors' renderings


def add_launch_arguments(parser: argparse.ArgumentParser, door: str = RUN, only: Sequence[str] = ()) -> None:
    """Every launch option that ``door`` takes, as ``parser``'s arguments (parse them with :func:`launch_options`);
    ``only``: those of these ``--help`` sections alone (:data:`WHERE`)."""
    add_arguments(parser, LaunchOptions, door, GROUPS, only)


#: The sections of the options that say where a run's ranks run, on which devices: what ``nbddp doctor`` examines.
WHERE = (_DEVICES, _NODES, _CLUSTER, _RAY, _SLURM)


#: Runs of a ``--slurm`` batch at once by default: the cluster queues them, this machine runs their kernels.
SLURM_PARALLEL = 4
#: ``--help``'s section of a batch's own options.
SWEEP = "batch"


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    """A batch's own options (``nbddp batch``, ``nbddp.batch()``), beside every run's :class:`LaunchOptions`."""

    gpus_per_run: int | None = option(
        "--gpus-per-run", doors=frozenset({BATCH}), group=SWEEP, default=None, type=int, metavar="K",
        check=_at_least(1, "need at least 1"), help="GPUs per run (default 1; --gpus K says the same)")
    parallel: int | None = option(
        "--parallel", doors=frozenset({BATCH}), group=SWEEP, default=None, type=int, metavar="J",
        check=_at_least(1, "need at least 1"),
        help=f"runs at once (CPU default 1; --slurm default {SLURM_PARALLEL}; --ray default 1)")
    out: Path | None = option(
        "--out", doors=frozenset({BATCH}), group=SWEEP, default=None, type=Path, coerce=_path,
        help="batch folder (default: batches/STEM-TIME)")
    resume: bool = option(
        "--resume", doors=frozenset({BATCH}), group=SWEEP, default=False, action="store_true",
        help="skip runs of --out that already succeeded")
    fresh: bool = option(
        "--fresh", doors=frozenset({BATCH}), group=SWEEP, default=False, action="store_true",
        help="start every run's ranks anew (default: a device slot's runs share warm ranks)")
    """Every run on ranks of its own (by default a device slot's runs share warm ranks, as ``%%ddp_train`` re-runs
    do)."""

    def __post_init__(self) -> None:
        check_fields(self)


def choices(name: str) -> tuple[str, ...]:
    """The values launch option ``name`` may take, as declared (for a door that lists them: nbconvert's ``engine``)."""
    return next(found.option.choices or () for found in declared(LaunchOptions) if found.name == name)


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The validated options from what :func:`add_launch_arguments` parsed."""
    return LaunchOptions(**values_from(LaunchOptions, args))


def options_table() -> str:
    """The table of launch options, as docs/reference/options.md shows it (written by docs/hooks.py as the site is
    built)."""
    return "\n".join(markdown_rows(LaunchOptions, GROUPS, DOORS))


def add_detach_argument(parser: argparse.ArgumentParser) -> None:
    """``--detach`` (``nbddp run``, ``%%ddp_train``): a door's option, not the run's (the supervisor runs it
    attached)."""
    parser.add_argument("--detach", action="store_true",
                        help="a supervisor owns the run: closing the terminal or notebook, or restarting the kernel, "
                             "leaves it going; follow it again with `nbddp attach RUN` (%%ddp_attach RUN)")


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
