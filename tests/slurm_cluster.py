"""A real single-node Slurm cluster for the tests: Debian's ``slurm-wlm`` and ``munge``, run as root.

Everything lives in one temp folder (munge key and socket, slurm.conf, state, spool, logs, pid
files) on free ports, so it never touches a system Slurm and two test sessions never collide.
``.ci/run`` installs the packages; without them the Slurm tests skip, unless
``NBDDP_REQUIRE_SLURM=1`` (set by ``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from tests.conftest import settled, wait_until

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")


def missing_tools() -> list[str]:
    paths = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [tool for tool in DAEMONS if shutil.which(tool, path=paths) is None]


def free_port() -> int:
    """A TCP port free on loopback now (for a test's own server), below the ephemeral range (nbddp.contracts.ports)."""
    from nbddp.contracts.ports import free_port as below_the_ephemeral_range

    return below_the_ephemeral_range()


class SlurmCluster:
    """Start with :meth:`start`, stop with :meth:`stop`; :attr:`env` points Slurm's commands at it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self.host = socket.gethostname()

    def start(self) -> "SlurmCluster":
        root = self.root
        for sub in ("state", "spool", "log", "munge"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o755)  # munged wants its socket's folder reachable by everyone
        key = root / "munge" / "munge.key"
        self._run(["mungekey", "-c", "-k", str(key)])
        self.munge_socket = root / "munge" / "socket"
        self._run(["munged", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                   f"--pid-file={root / 'munge' / 'pid'}", f"--log-file={root / 'munge' / 'log'}",
                   f"--seed-file={root / 'munge' / 'seed'}"])
        cpus = os.cpu_count() or 2
        self.conf.write_text("\n".join([
            "ClusterName=nbddptest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            # A job that becomes eligible later (--begin) starts at the next scheduling pass: every second here,
            # not Slurm's default minute (main loop) or 30 s (backfill).
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "MpiDefault=none", "ReturnToService=2", "InactiveLimit=0", "KillWait=5", "MinJobAge=300",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN",
            # Preemption as clusters with a "scavenger" partition do it: an urgent job takes the node, the
            # preempted job gets its --signal at once and GraceTime to save, then Slurm requeues it.
            "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
            "SlurmctldParameters=preempt_send_user_signal",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4 PriorityTier=1 "
            "GraceTime=60",
            "PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10",
        ]) + "\n")
        self._run(["slurmctld", "-f", str(self.conf)])
        self._run(["slurmd", "-f", str(self.conf)])

        def state() -> str:
            return self.command(["sinfo", "-h", "-o", "%T"], check=False).stdout.strip()

        wait_until(lambda: state() in ("idle", "mixed", "allocated"), 60, "the test Slurm cluster idle", every=0.5,
                   detail=lambda: f"sinfo: {state()!r}; see {root / 'log'}")
        return self

    def command(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True, text=True, check=check,
                              timeout=60)

    def queue(self) -> list[str]:
        """Job ids Slurm still lists (any state but gone)."""
        return self.command(["squeue", "-h", "-o", "%i"]).stdout.split()

    def wait_until_empty(self, timeout: float = 60, what: str = "the Slurm queue empty") -> list[str]:
        """``[]`` once Slurm lists no job; after ``timeout`` s the test fails with ``what`` and the jobs left."""
        wait_until(lambda: not self.queue(), timeout, what, every=0.5, detail=lambda: f"jobs: {self.queue()}")
        return []

    def stop(self) -> None:
        self.command(["scancel", "--full", "--user=root"], check=False)
        try:
            self.wait_until_empty(timeout=30, what="every job cancelled as the test Slurm cluster stops")
        finally:
            for pid_file in (self.root / "slurmd.pid", self.root / "slurmctld.pid", self.root / "munge" / "pid"):
                try:
                    pid = int(pid_file.read_text().strip())
                    os.kill(pid, signal.SIGTERM)
                except (OSError, ValueError):
                    continue
                if not settled(lambda: not _alive(pid), 15):  # (its grace is over: it is stopped all the same)
                    os.kill(pid, signal.SIGKILL)

    def _run(self, argv: list[str]) -> None:
        argv = [shutil.which(argv[0], path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or argv[0], *argv[1:]]
        subprocess.run(argv, env={**os.environ, **self.env}, check=True, capture_output=True, timeout=60)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
