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
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

from nbddp.devices import CPU_PROCESSES, requested_gpus
from nbddp.engines import DEFAULT_RETURNS, ENGINES, shard_refusal, spawns_its_own_ranks
from nbddp.errors import UsageError
from nbddp.job.status import Status
from nbddp.rank_side.env import DEFAULT_RDZV_TIMEOUT, DEFAULT_WARM_IDLE  # (owned there: the ranks fall back on them)

if TYPE_CHECKING:
    from nbddp.notebook.script import ExportOptions

#: ``--collective-timeout``: long enough for a slow epoch's all-reduce, far below torch's 30 minutes.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
_SLURM_KEY = re.compile(r"[A-Za-z][A-Za-z0-9-]*")
#: Options nbddp writes itself: given with --slurm-arg they would contradict the run's own.
_SLURM_OWN = ("nodes", "ntasks", "ntasks-per-node", "output", "error", "gpus-per-node", "chdir", "wait", "array",
              "export", "requeue", "no-requeue", "test-only", "parsable", "hold", "clusters", "M", "wrap",
              "job-name", "cpus-per-task")
#: Options a job that requeues itself sets (``--no-requeue`` leaves them to the user).
_SLURM_REQUEUE_OWN = ("signal", "open-mode")
#: ``--max-requeues``' default: as submitit's ``max_num_timeout``.
DEFAULT_MAX_REQUEUES = 3


@dataclass(frozen=True)
class Nodes:
    """One node's part in a multi-node run (``--nnodes/--node-rank/--rdzv-endpoint``, as torchrun's)."""

    count: int
    rank: int
    endpoint: str
    """``HOST:PORT`` of node 0, where the rendezvous store listens."""

    def __post_init__(self) -> None:
        if self.count < 2:
            raise UsageError(f"--nnodes {self.count}: several nodes means 2 or more (one machine needs no --nnodes).")
        if not 0 <= self.rank < self.count:
            raise UsageError(f"--node-rank {self.rank}: give 0 to {self.count - 1} for --nnodes {self.count}.")
        self.host_port()

    def host_port(self) -> tuple[str, int]:
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--rdzv-endpoint {self.endpoint!r}: give HOST:PORT of node 0 (e.g. node0:29500).")
        return host.strip("[]"), int(port)


@dataclass(frozen=True)
class SlurmRequest:
    """What a ``--slurm`` run asks the cluster for."""

    nodes: int = 1
    gpus_per_node: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    extra: tuple[tuple[str, str], ...] = ()
    """``--slurm-arg KEY=VALUE``: any other sbatch option, passed on as ``--KEY=VALUE``."""
    requeue: bool | None = None
    """``--requeue`` / ``--no-requeue``; ``None``: requeue when the training code calls ``nbddp.save_checkpoint``."""
    max_requeues: int = DEFAULT_MAX_REQUEUES
    """``--max-requeues``: how many times the job may be requeued (by itself, or by Slurm) before it fails."""

    def __post_init__(self) -> None:
        if self.max_requeues < 0:
            raise UsageError(f"--max-requeues {self.max_requeues}: give 0 or more.")
        if self.nodes < 1:
            raise UsageError(f"--nodes {self.nodes}: need at least 1 node.")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise UsageError(f"--gpus-per-node {self.gpus_per_node}: need at least 1 (or --cpu --nproc P).")
        if self.time is not None and not re.fullmatch(r"\d+(-\d+)?(:\d+){0,2}|UNLIMITED|INFINITE", self.time):
            raise UsageError(f"--time {self.time!r}: give a Slurm time limit (MINUTES, HH:MM:SS or D-HH:MM:SS).")
        for flag, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and (not value.strip() or any(c.isspace() for c in value)):
                raise UsageError(f"{flag} {value!r}: give a name without spaces.")
        for key, value in self.extra:
            if not _SLURM_KEY.fullmatch(key):
                raise UsageError(f"--slurm-arg {key}={value}: KEY is an sbatch option name without dashes (e.g. qos=high).")
            if key in _SLURM_REQUEUE_OWN and self.requeue is not False:
                raise UsageError(f"--slurm-arg {key}=...: a job that requeues itself sets --{key} itself; "
                                 "give --no-requeue to set your own.")
            if key in _SLURM_OWN or key in ("partition", "time", "account"):
                raise UsageError(f"--slurm-arg {key}=...: nbddp sets --{key} itself, or depends on it for the run's job"
                                 + (f"; use nbddp's --{key}." if key in ("nodes", "partition", "time", "account",
                                                                       "gpus-per-node") else "."))
            if "\n" in value or "\r" in value or "\0" in value:
                raise UsageError(f"--slurm-arg {key}: the value can't span lines.")

    def to_argv(self) -> list[str]:
        argv = ["--slurm"]
        for flag, value in (("--nodes", self.nodes if self.nodes != 1 else None), ("--gpus-per-node", self.gpus_per_node),
                            ("--partition", self.partition), ("--time", self.time), ("--account", self.account)):
            if value is not None:
                argv += [flag, str(value)]
        for key, value in self.extra:
            argv += ["--slurm-arg", f"{key}={value}"]
        if self.requeue is not None:
            argv.append("--requeue" if self.requeue else "--no-requeue")
        if self.max_requeues != DEFAULT_MAX_REQUEUES:
            argv += ["--max-requeues", str(self.max_requeues)]
        return argv

    def requeues(self, saves_checkpoints: bool) -> bool:
        """Whether the job requeues itself when Slurm signals it: as asked, else when there is a checkpoint
        to resume from."""
        return saves_checkpoints if self.requeue is None else self.requeue


#: ``--ray`` without an address: Ray's own rule, ``RAY_ADDRESS`` else the cluster started on this machine.
RAY_AUTO = "auto"


@dataclass(frozen=True)
class RayRequest:
    """What a ``--ray`` run asks the cluster for."""

    address: str = RAY_AUTO
    """``auto``, ``HOST:PORT`` of the head (this machine is one of the cluster's nodes) or ``ray://HOST:PORT``
    (Ray Client, from outside the cluster)."""
    nodes: int = 1
    gpus_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise UsageError(f"--nodes {self.nodes}: need at least 1 node.")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise UsageError(f"--gpus-per-node {self.gpus_per_node}: need at least 1 (or --cpu --nproc P).")
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

    def to_argv(self) -> list[str]:
        argv = ["--ray"] + ([self.address] if self.address != RAY_AUTO else [])
        if self.nodes != 1:
            argv += ["--nodes", str(self.nodes)]
        if self.gpus_per_node is not None:
            argv += ["--gpus-per-node", str(self.gpus_per_node)]
        return argv


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
    shard: bool = False
    """``--shard``: every ``nbddp.prepare(model)`` shards the model with FSDP2 instead of wrapping it in DDP."""
    run_dir: Path | None = None
    timeout: float | None = None
    collective_timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT
    idle_timeout: float | None = None
    max_restarts: int = 0
    nodes: Nodes | None = None
    """This node's part in a multi-node run; ``None`` on one machine."""
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT
    slurm: SlurmRequest | None = None
    """Run the ranks as a Slurm job; ``None`` runs them here."""
    ray: RayRequest | None = None
    """Run the ranks on a Ray cluster's workers; ``None`` runs them here."""

    def __post_init__(self) -> None:
        from nbddp.notebook.literals import check_name

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
        if self.shard and self.engine not in (None, "torch"):
            raise UsageError(shard_refusal(self.engine))
        if self.max_restarts and spawns_its_own_ranks(self.engine):
            raise UsageError("--max-restarts needs the torch engine or a library's (torchrun restarts their ranks); "
                             "Catalyst's spawn can't.")
        if not (self.rdzv_timeout > 0 and math.isfinite(self.rdzv_timeout)):
            raise UsageError(f"--rdzv-timeout {self.rdzv_timeout:g}: give a positive number of seconds.")
        self._check_topology()

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
        flag = "--slurm" if self.slurm is not None else "--ray"
        if self.nodes is not None:
            raise UsageError(f"{flag} chooses the nodes itself: drop --nnodes/--node-rank/--rdzv-endpoint "
                             "(use --nodes N for the node count).")
        if self.gpus is not None:
            raise UsageError(f"--gpus counts this machine's GPUs; with {flag} say --gpus-per-node G.")
        if cluster.gpus_per_node is not None and (self.cpu or self.nproc is not None):
            raise UsageError("--gpus-per-node and --cpu/--nproc contradict each other: choose one.")
        if self.ray is not None and spawns_its_own_ranks(self.engine):
            raise UsageError(ray_refusal(self.engine))

    def export_options(self, **more: Any) -> "ExportOptions":
        """What of these options shapes the script (the engine, parameters, returns, sharding), plus ``more``."""
        from nbddp.notebook.script import ExportOptions

        return ExportOptions(**{"engine": self.engine, "parameters": self.parameters, "returns": self.returns,
                                "shard": self.shard, **more})

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
        if self.shard:
            argv.append("--shard")
        if self.max_restarts:
            argv += ["--max-restarts", str(self.max_restarts)]
        if self.returns != DEFAULT_RETURNS:
            argv += ["--return", ",".join(self.returns)]
        for name, value in self.parameters.items():
            argv += ["-p", name, _value_arg(value)]
        if self.nodes is not None:
            argv += ["--nnodes", str(self.nodes.count), "--node-rank", str(self.nodes.rank),
                     "--rdzv-endpoint", self.nodes.endpoint]
        if self.rdzv_timeout != DEFAULT_RDZV_TIMEOUT:
            argv += ["--rdzv-timeout", str(self.rdzv_timeout)]
        if self.slurm is not None:
            argv += self.slurm.to_argv()
        if self.ray is not None:
            argv += self.ray.to_argv()
        return argv


def ray_refusal(engine: str) -> str:
    """Why an engine that spawns its own ranks can't run on Ray (every rank is a Ray actor's process)."""
    return (f"--ray: the {engine} engine spawns its own ranks from one process (mp.spawn), but on a Ray cluster "
            "each rank is a process of its own Ray actor, placed by Ray. Use the torch engine (--engine torch, with "
            "nbddp.prepare(model)), or run Catalyst here or with --slurm.")


def _value_arg(value: Any) -> str:
    """``-p`` text that parses back to exactly ``value`` (a string stays a string, never a literal)."""
    from nbddp.notebook.literals import parse_value

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
                     help="DDP engine (default: from the training cells: catalyst for runner.train(loaders=...), "
                          "accelerate for notebook_launcher/Accelerator, lightning for Trainer.fit, transformers "
                          "for a Hugging Face Trainer's train(), else torch)")
    job.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"), dest="parameters",
                     help="override a parameter (value read as a Python literal, else a string)")
    job.add_argument("--return", dest="returns", default=",".join(DEFAULT_RETURNS), metavar="NAME[,NAME...]",
                     help="variables whose trained state comes back (default: model)")
    job.add_argument("--shard", action="store_true",
                     help="shard models with FSDP2: every nbddp.prepare(model) applies fully_shard instead of DDP "
                          "(torch engine)")


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    devices = parser.add_argument_group("devices")
    devices.add_argument("--gpus", default=None, metavar="N|all", help="GPUs to use (default: all visible)")
    devices.add_argument("--cpu", action="store_true", help="run CPU processes with gloo, even with GPUs")
    devices.add_argument("--nproc", type=int, default=None, help=f"CPU processes (default {CPU_PROCESSES})")


def add_launch_arguments(parser: argparse.ArgumentParser, *, run_dir: bool = True) -> None:
    """Every launch option, for every front door (``run_dir=False`` where a folder of runs is named instead)."""
    add_script_arguments(parser)
    add_device_arguments(parser)
    limits = parser.add_argument_group("run")
    if run_dir:
        limits.add_argument("--run-dir", type=Path, default=None,
                            help="where the script, logs and weights go (default: runs/STEM-TIME beside the notebook)")
    limits.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help=f"stop the run after this long (exit {Status.TIMEOUT.exit_code})")
    limits.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT, metavar="SECONDS",
                        help=f"a rank waiting longer than this in a collective fails the run, exit "
                             f"{Status.TIMEOUT.exit_code} (default {DEFAULT_COLLECTIVE_TIMEOUT:g}; 0: torch's own)")
    limits.add_argument("--idle-timeout", type=float, default=None, metavar="SECONDS",
                        help=f"stop the run (exit {Status.TIMEOUT.exit_code}) when no rank prints or logs anything "
                             "for this long")
    limits.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="restart failed ranks up to N times (torch engine); pair with nbddp.save_checkpoint/restore")
    add_topology_arguments(parser)


def add_detach_argument(parser: argparse.ArgumentParser) -> None:
    """``--detach`` (``nbddp run``, ``%%ddp_train``): a door's option, not the run's (the supervisor runs it attached)."""
    parser.add_argument("--detach", action="store_true",
                        help="a supervisor owns the run: closing the terminal or notebook, or restarting the kernel, "
                             "leaves it going; follow it again with `nbddp attach RUN` (%%ddp_attach RUN)")


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    """Several nodes (torchrun's flags, same meaning) and Slurm."""
    nodes = parser.add_argument_group("several nodes (run the same command on every node)")
    nodes.add_argument("--nnodes", type=int, default=None, metavar="N", help="number of nodes")
    nodes.add_argument("--node-rank", type=int, default=None, metavar="R",
                       help="this node's rank, 0 to N-1; node 0 runs the notebook's kernel and gets the weights")
    nodes.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="node 0's address and a free port there (its rendezvous store listens on it)")
    nodes.add_argument("--rdzv-timeout", type=float, default=DEFAULT_RDZV_TIMEOUT, metavar="SECONDS",
                       help=f"how long nodes wait for each other at the start; with --ray, how long the run waits "
                            f"for the cluster's resources (default {DEFAULT_RDZV_TIMEOUT:g})")
    clusters = parser.add_argument_group("a cluster's nodes (--slurm or --ray)")
    clusters.add_argument("--nodes", type=int, default=None, metavar="N", help="nodes to ask for (default 1)")
    clusters.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                          help="GPUs per node (default: Slurm's partition's, else --cpu; on Ray: --cpu)")
    ray = parser.add_argument_group("ray (the ranks run on a Ray cluster's workers; the kernel runs here)")
    ray.add_argument("--ray", nargs="?", const=RAY_AUTO, default=None, metavar="ADDRESS",
                     help="run the training on a Ray cluster: HOST:PORT of its head, ray://HOST:PORT (Ray Client), "
                          "or nothing for RAY_ADDRESS, else the cluster started on this machine")
    slurm = parser.add_argument_group("slurm (the ranks run as a Slurm job; the kernel runs here)")
    slurm.add_argument("--slurm", action="store_true", help="submit the training as a Slurm job")
    slurm.add_argument("--partition", default=None, metavar="P")
    slurm.add_argument("--time", default=None, metavar="T", help="time limit, as sbatch's --time")
    slurm.add_argument("--account", default=None, metavar="A")
    slurm.add_argument("--slurm-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="any other sbatch option, e.g. qos=high (repeatable)")
    slurm.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=None,
                       help="before the time limit and on preemption, stop every rank at its next "
                            "nbddp.save_checkpoint and requeue the job, which resumes there (default: on when the "
                            "training code calls nbddp.save_checkpoint)")
    slurm.add_argument("--max-requeues", type=int, default=None, metavar="N",
                       help=f"fail instead of a requeue beyond the N-th (default {DEFAULT_MAX_REQUEUES})")


def topology(args: argparse.Namespace) -> tuple[Nodes | None, SlurmRequest | None, RayRequest | None]:
    """The multi-node, Slurm and Ray parts of what :func:`add_topology_arguments` parsed, checked."""
    nodes = None
    if args.nnodes not in (None, 1) or args.node_rank is not None or args.rdzv_endpoint is not None:
        if args.nnodes is None or args.rdzv_endpoint is None or args.node_rank is None:
            raise UsageError("several nodes need --nnodes N, --node-rank R and --rdzv-endpoint HOST:PORT together.")
        nodes = Nodes(args.nnodes, args.node_rank, args.rdzv_endpoint)
    slurm_only = {"--partition": args.partition, "--time": args.time, "--account": args.account,
                  "--slurm-arg": args.slurm_arg or None, "--requeue/--no-requeue": args.requeue,
                  "--max-requeues": args.max_requeues}
    ray_address = getattr(args, "ray", None)
    if args.slurm and ray_address is not None:
        raise UsageError("--slurm and --ray contradict each other: choose the cluster the ranks run on.")
    if not args.slurm:
        given = [flag for flag, value in slurm_only.items() if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: only with --slurm.")
        if ray_address is not None:
            return nodes, None, RayRequest(ray_address, 1 if args.nodes is None else args.nodes, args.gpus_per_node)
        given = [flag for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node))
                 if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: only with --slurm or --ray (a cluster's nodes).")
        return nodes, None, None
    extra = []
    for item in args.slurm_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--slurm-arg {item!r}: give KEY=VALUE (e.g. qos=high).")
        extra.append((key.strip().lstrip("-"), value))
    return nodes, SlurmRequest(1 if args.nodes is None else args.nodes, args.gpus_per_node, args.partition,
                               args.time, args.account, tuple(extra), args.requeue,
                               DEFAULT_MAX_REQUEUES if args.max_requeues is None else args.max_requeues), None


def parse_returns(text: str) -> tuple[str, ...]:
    """``--return model,optimizer`` → ``("model", "optimizer")``."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def script_arguments(args: argparse.Namespace) -> LaunchOptions:
    """What :func:`add_script_arguments` parsed, checked: launch options with only the script's part set."""
    from nbddp.errors import ParameterError
    from nbddp.notebook.literals import parse_pairs

    try:
        parameters = parse_pairs(args.parameters)
    except ParameterError as exc:
        raise UsageError(f"-p: {exc}") from None
    return LaunchOptions(engine=args.engine, parameters=parameters, returns=parse_returns(args.returns),
                         shard=args.shard)


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The validated options from what :func:`add_launch_arguments` parsed."""
    script = script_arguments(args)
    nodes, slurm, ray = topology(args)
    return LaunchOptions(
        gpus=args.gpus, cpu=args.cpu, nproc=args.nproc, engine=script.engine, parameters=script.parameters,
        returns=script.returns, shard=script.shard,
        run_dir=getattr(args, "run_dir", None), timeout=args.timeout,
        collective_timeout=args.collective_timeout, idle_timeout=args.idle_timeout,
        max_restarts=args.max_restarts, nodes=nodes, rdzv_timeout=args.rdzv_timeout, slurm=slurm,
        ray=ray,
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
