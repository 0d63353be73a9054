"""One DDP job: ``start()`` that fully starts it or leaves nothing behind; following it while it runs;
and gathering the evidence that :func:`nbddp.job.outcome.judge` turns into the outcome.

Every front door's job is one of these, started and followed by :mod:`nbddp.job.orchestrator`. What it
runs is its :class:`~nbddp.plan.job_spec.JobSpec`; how the processes are started is the launcher's business
(:mod:`nbddp.launchers`), and the :class:`~nbddp.launchers.base.Launch` it returns owns them; what the
launcher saw comes back as data (:meth:`~nbddp.launchers.base.Launcher.observe`). The run dir is named
by :mod:`nbddp.contracts.rundir`, ``result.json`` written by :mod:`nbddp.job.record`.
"""

from __future__ import annotations

import re
import signal
import socket
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from nbddp.contracts.atomic import read_json
from nbddp.job import registry
from nbddp.engines import spawns_its_own_ranks
from nbddp.contracts.errors import UsageError
from nbddp.launchers import launcher_for
from nbddp.launchers.base import Launch, Launcher
from nbddp.job.diagnosis import diagnosed
from nbddp.job.outcome import PEER_GONE, Evidence, JobOutcome, Status, judge
from nbddp.contracts.process_groups import process_alive
from nbddp.job.rank_output import QuietStream
from nbddp.contracts.rank_env import RankEnv
from nbddp.contracts.metrics import last_metrics
from nbddp.job.record import RunRecord, rank_errors, record_job
from nbddp.contracts.rundir import rank_of
from nbddp.plan.job_spec import JobSpec
from nbddp.job.torch_leftovers import TorchLeftovers
from nbddp.notebook.script import write_script
from nbddp.job.follow import LogLine, RunFollower, Sink
from nbddp.job.debugger import Console, Relayed, relay_open

POLL_SECONDS = 0.05
#: Polls are this much closer during a job's first seconds: a warm re-run's whole job, and the first
#: lines of any run, are that short (a hand-off through files costs at most one poll).
FIRST_POLL_SECONDS, FIRST_SECONDS = 0.01, 2.0
RANK_CHECK_SECONDS = 0.5
_HOST = socket.gethostname()
#: Beyond ``--rdzv-timeout``: time for torch to report the failure itself, with its own words.
RENDEZVOUS_GRACE_SECONDS = 5.0


class Job:
    """A started job. Always ends through :meth:`wait` or :meth:`stop` (use ``with``)."""

    def __init__(self, spec: JobSpec, launcher: Launcher, launch: Launch, live: registry.LiveRun,
                 leftovers: TorchLeftovers | None = None) -> None:
        self.spec, self.launcher, self.launch, self.live = spec, launcher, launch, live
        self.leftovers = leftovers
        self.script, self.devices = spec.script, spec.devices
        self.paths = spec.run_dir
        self.run_dir = spec.run_dir.path
        """Where the run's files are, as the user is shown it."""
        self.checkpoint = self.paths.weights
        self.script_path = self.paths.script
        self.collective_timeout = spec.launch.collective_timeout
        self.early_exit: int | None = None
        self.deadline_name = "--timeout"
        self.idle_for: float | None = None
        self.rendezvous_expired = False
        self.restarts_said = 0
        self.started_at, self.started_monotonic = time.time(), time.monotonic()
        self.follower = RunFollower(spec.run_dir, include_launcher=launcher.streams_launcher_log)
        self.quiet = QuietStream(spec.script.source_map, self.local_ranks())

    @classmethod
    def start(cls, spec: JobSpec) -> "Job":
        """Write the script, start the ranks through the launcher seam, register the run: all of it,
        or nothing left running."""
        launcher = launcher_for(spec)
        leftovers = TorchLeftovers()
        if spec.launch.max_restarts and not launcher.supports_restarts:
            raise UsageError(f"--max-restarts needs torchrun to restart the ranks; this run's launcher "
                             f"({launcher.name}) can't.")
        paths = spec.run_dir
        script_path, _ = write_script(spec.script, paths.script)
        paths.logs.mkdir(exist_ok=True)
        rank_env = RankEnv(run_dir=paths, device=spec.devices.kind, nproc=spec.devices.nproc, checkpoint=paths.weights,
                           collective_timeout=spec.launch.collective_timeout, log_cap=spec.launch.log_cap).variables()
        rank_env |= spec.devices.environment()  # the GPUs chosen by name (--gpus free, --wait)
        rank_env |= spec.environment  # the kernel's open experiment records, for rank 0
        launch = launcher.start(script_path, spec, rank_env)
        try:
            live = registry.register(spec.run_dir.path, launch.pgid, spec.script.engine, spec.world_size, spec.owner,
                                     launcher.stop_grace)
            return cls(spec, launcher, launch, live, leftovers)
        except BaseException:
            launch.stop()
            raise

    def pump(self, sinks: Sequence[Sink], final: bool = False) -> bool:
        """Deliver what the ranks wrote since the last call.

        All files are read before any sink runs: a slow sink (a plot being drawn) must not
        stretch the moments at which different ranks' files are read, or their lines interleave badly.
        """
        events = list(self.follower.poll(final=final))
        for event in self.quiet.feed(events, final=final):
            for sink in sinks:
                sink(event)
        return bool(events)

    def wait(self, sinks: Sequence[Sink], deadline: float | None = None,
             idle_timeout: float | None = None, heartbeat: Callable[[], Any] | None = None,
             deadline_name: str = "--timeout", console: Console | None = None) -> JobOutcome:
        """Stream until the job ends, then judge it; ``heartbeat`` is called on every poll (a view
        refreshing its clock; a kernel noticing it is being shut down). Stops every rank first when:

        * the monotonic ``deadline`` passes (``--timeout``, or the limit ``deadline_name`` names),
        * no rank printed or logged anything for ``idle_timeout`` seconds (``--idle-timeout``),
        * a rank ended without finishing while the others still run (it would leave them
          waiting in a collective: a hang, not a failure, under NCCL),
        * or anything is raised here (KeyboardInterrupt included), which then propagates.

        ``console``: a rank's debugger session (a ``breakpoint()``) is relayed there as it opens; the time a
        person spends in it doesn't count towards the deadline or the idle timeout.
        """
        sessions = Relayed(self.paths.debug)
        last_activity = last_check = time.monotonic()
        timed_out = False
        self.deadline_name = deadline_name
        try:
            while self.launch.poll() is None:
                now = time.monotonic()
                if self.pump(sinks):
                    last_activity = now
                if heartbeat is not None:
                    heartbeat()
                if console is not None:
                    spent = relay_open(sessions, console, lambda: self.launch.poll() is None)
                    if spent:
                        now, last_activity = now + spent, last_activity + spent
                        deadline = deadline + spent if deadline is not None else None
                if deadline is not None and now > deadline:
                    timed_out = True
                elif idle_timeout and now - last_activity > idle_timeout:
                    self.idle_for, timed_out = idle_timeout, True
                elif now - last_check > RANK_CHECK_SECONDS:
                    last_check = now
                    self.early_exit = self._rank_ended_early()
                    self.rendezvous_expired = self._rendezvous_expired()
                    if self.spec.launch.max_restarts:
                        self._say_restarts(sinks)
                if timed_out or self.early_exit is not None or self.rendezvous_expired:
                    self.launch.stop(signal.SIGTERM)
                    break
                time.sleep(FIRST_POLL_SECONDS if now - self.started_monotonic < FIRST_SECONDS else POLL_SECONDS)
        except BaseException:
            self.launch.stop(signal.SIGTERM)
            self.pump(sinks, final=True)
            raise
        if self.launch.stopped_by is None and self.launch.alive():
            self.launch.stop(signal.SIGTERM, reap=True)  # the launcher left stragglers behind
        self.pump(sinks, final=True)
        return self.outcome(timed_out=timed_out, sinks=sinks)

    def _say_restarts(self, sinks: Sequence[Sink]) -> None:
        """torchrun started the ranks again (``--max-restarts``): said as it happens, with why, on the launcher's
        line; the ending and ``result.json`` count them too."""
        attempt = self.paths.restarts()
        if attempt <= self.restarts_said:
            return
        self.restarts_said = attempt
        raised = [error for error in rank_errors(self.paths, self.script.source_map) if error.attempt == attempt - 1]
        raised = [error for error in raised if not PEER_GONE.search(error.message)] or raised  # not those it broke
        why = "; ".join(f"rank {error.rank} raised {error.type}: {error.message.strip()[:160]}" for error in raised
                        ) or self.launcher.failed_attempt(self.launcher.report(self.paths))
        line = (f"restart {attempt} of {self.spec.launch.max_restarts} (--max-restarts): {why or 'a rank failed'}; "
                "every rank starts its script again (nbddp.restore() resumes from the last checkpoint)")
        for sink in sinks:
            sink(LogLine(None, line))

    def _rank_ended_early(self, despite_errors: bool = False, live: bool = True) -> int | None:
        """A rank whose process is gone with neither a 'done' mark nor an error report.

        While any rank has reported an error, a rank killed by the launcher in response looks
        the same, so nobody is blamed unless ``despite_errors`` (the error says a peer vanished).
        ``live``: called while the job runs, so a launcher exiting meanwhile defers to its report.
        """
        paths = self.paths
        if not despite_errors and paths.error_reports():
            return None  # (after a restart too: stale reports make this check conservative)
        for info in paths.started_ranks():
            rank = rank_of(info)
            if paths.rank_done(rank).exists() or paths.rank_error(rank).exists():
                continue
            started = read_json(info)
            if not isinstance(started, dict) or "pid" not in started:
                continue
            pid = started["pid"]
            if started.get("host", _HOST) != _HOST:
                continue  # a rank of another node (a shared run dir under Slurm): its node reports it
            attempt = int(started.get("attempt", 0))
            if not process_alive(pid) and not self.launcher.between_attempts(paths, attempt):
                # Its error report or done mark may be a moment behind its exit; and a launcher that
                # saw it die (a signal, a crash) exits within its monitor interval with a better report,
                # or says the job is being requeued.
                deadline = time.monotonic() + self.launcher.exit_settle
                while time.monotonic() < deadline:
                    if (live and self.launch.poll() is not None) or paths.rank_done(rank).exists() \
                            or paths.rank_error(rank).exists() or self.launcher.between_attempts(paths, attempt):
                        return None
                    time.sleep(0.05)
                return rank
        return None

    def _rendezvous_expired(self) -> bool:
        """A multi-node run whose nodes haven't all met ``--rdzv-timeout`` (+ a grace) after it started.

        torch bounds the wait itself, but its store client retries once after a random delay, so a
        node could wait up to twice the timeout; this keeps the promise. The roster (``nodes.json``)
        is written once every node has joined; torchrun starts a node's ranks once its agents have met.
        """
        if self.spec.launch.nodes is None or spawns_its_own_ranks(self.script.engine) or self.paths.nodes.exists():
            return False  # (Catalyst's ranks meet inside runner.train; their own init timeout bounds it)
        if self.paths.started_ranks():
            return False  # torchrun starts ranks only once the nodes have met
        return time.time() - self.started_at > self.spec.launch.rdzv_timeout + RENDEZVOUS_GRACE_SECONDS

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.launch.stop(sig)

    def evidence(self, timed_out: bool = False, interrupted_by: int | None = None) -> Evidence:
        """What the job's processes left behind, for :func:`nbddp.job.outcome.judge`."""
        latest = self.paths.restarts()  # errors of attempts torchrun recovered from don't count
        errors = tuple(e for e in rank_errors(self.paths, self.script.source_map) if e.attempt >= latest)
        seen = self.launcher.observe(self.paths, expired=self.rendezvous_expired)
        evidence = Evidence(
            run_dir=self.paths, notebook=self.script.source_map.notebook, launcher_exit=self.launch.poll(),
            rank_exit_codes=seen.rank_exit_codes, errors=errors, done_ranks=self.paths.done_ranks(),
            checkpoint_exists=self.checkpoint.exists(), root_cause=seen.root_cause, launcher_tail=seen.tail,
            stop_requested=self.paths.stop_mark.exists(),
            timed_out=timed_out, idle_for=self.idle_for if timed_out else None, interrupted_by=interrupted_by,
            deadline_name=self.deadline_name,
            stopped_by=self.launch.stopped_by, early_exit=self.early_exit,
            collective_timeout=self.collective_timeout, nproc=self._local_ranks(), first_rank=self._first_rank(),
            checkpoint_expected=(bool(self.script.returns)
                                 and (self.spec.launch.nodes is None or self.spec.launch.nodes.rank == 0)),
            final_metrics=last_metrics(self.paths), rendezvous_failure=seen.rendezvous_failure,
            scheduler_end=seen.scheduler_end, warm=self.spec.pool is not None,
        )
        if evidence.early_exit is None and evidence.peer_gone and not evidence.stop_requested:  # who vanished?
            self.early_exit = self._rank_ended_early(despite_errors=True, live=False)
            evidence = replace(evidence, early_exit=self.early_exit)
            if self.early_exit is None and self.spec.launch.nodes is not None:
                evidence = replace(evidence, node_gone=node_gone(self.paths.roster(), self.spec.launch.nodes.rank,
                                                                 errors[0].message))
        return evidence

    def _first_rank(self) -> int:
        return self.spec.launch.nodes.rank * self.devices.nproc if self.spec.launch.nodes else 0

    def _local_ranks(self) -> int:
        """How many ranks this job's launcher runs (one node's, unless Slurm runs every node's)."""
        return self.spec.world_size if self.spec.launch.slurm or self.spec.launch.ray else self.devices.nproc

    def local_ranks(self) -> range:
        """The global ranks whose output this job streams."""
        return range(self._first_rank(), self._first_rank() + self._local_ranks())

    def outcome(self, timed_out: bool = False, interrupted_by: int | None = None,
                sinks: Sequence[Sink] = ()) -> JobOutcome:
        """The judged outcome; a failure the machine usually causes with the doctor's check that explains it (said
        to ``sinks`` as it starts)."""
        evidence = self.evidence(timed_out, interrupted_by)

        def say(line: str) -> None:
            for sink in sinks:
                sink(LogLine(None, line))

        return diagnosed(judge(evidence), evidence, self.spec, say)

    def record(self, status: Status | str, exit_code: int, message: str, outcome: JobOutcome | None,
               parameters: dict[str, Any], notebook: str, overrides: dict[str, Any] | None = None,
               command: str = "", failure: dict[str, Any] | None = None) -> RunRecord:
        """``result.json`` for this job (:func:`nbddp.job.record.record_job`), written into the run dir and returned."""
        return record_job(self.spec, self.launcher, self.started_at, status, exit_code, message,
                          outcome.rank_exit_codes if outcome else {}, outcome.final_metrics if outcome else None,
                          parameters, notebook, overrides, command, failure)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.launch.poll() is None or self.launch.alive():
            self.launch.stop()
        registry.unregister(self.live)
        if self.leftovers is not None:
            self.leftovers.clean()


def node_gone(roster: list[dict[str, Any]], own_node: int, message: str) -> dict[str, Any] | None:
    """Which node of a multi-node run went away, from the roster and a rank's "closed by peer" error.

    With two nodes it is the other one; with more, the one whose address the error names, when
    exactly one does (on one host, several nodes share an address and nobody is blamed).
    """
    others = [node for node in roster if node.get("node") != own_node]
    if len(others) == 1:
        return others[0]
    address = re.search(r"\[([0-9a-fA-F.:]+)\]:\d+", message)
    named = [node for node in others if address and node.get("ip") == address.group(1)]
    return named[0] if len(named) == 1 else None
