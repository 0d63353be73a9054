"""A real local Ray cluster for the tests: ``ray start --head --block`` on loopback, in a temp folder.

A fixed CPU count and no GPUs, no dashboard, no usage stats, a small object store, free ports, and
a short temp folder of its own (Ray's socket paths must stay under 107 bytes), so it never touches
a cluster of the machine's and two test sessions never collide. Stopped by SIGTERM to the
``ray start --block`` process, whose handler takes the node's processes down (never
``ray stop --force``, which kills every Ray process on the machine). ``.ci/run`` installs Ray (the
``test`` extra); without it the Ray tests skip, unless ``NBDDP_REQUIRE_RAY=1`` (set by ``.ci/run``)
makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from tests.conftest import wait_until
from tests.slurm_cluster import free_port

#: What a Ray actor's worker process calls itself (``setproctitle``): ``ray::RankActor`` and its tasks.
ACTOR_TITLE = "ray::RankActor"


class RayCluster:
    """Start with :meth:`start`, stop with :meth:`stop`; :attr:`address` is its head's ``HOST:PORT``."""

    def __init__(self, cpus: int = 2) -> None:
        self.cpus = cpus
        self.temp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: Ray's socket paths
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []

    def start(self, timeout: float = 90.0, attempts: int = 3) -> "RayCluster":
        """Start the head; a start that fails is retried on fresh ports in a fresh folder.

        Ray gives a new raylet a fixed 30 s to register with its GCS (``ray/_private/node.py``),
        which a loaded 2-core CI machine can miss even with :func:`favour`; each failure's Ray logs
        are kept in the error if every try fails.
        """
        failures: list[str] = []
        for attempt in range(attempts):
            if attempt:  # (stop removed the last try's folder)
                self.temp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
                self.port = free_port()
                self.address = f"127.0.0.1:{self.port}"
            try:
                return self._start_once(timeout)
            except (RuntimeError, AssertionError) as failure:  # (exited, or not up in time)
                failures.append(f"{failure}\n{self.ray_logs()}")
                self.stop()
        raise RuntimeError(f"ray start failed {attempts} times:\n\n" + "\n\n".join(failures))

    def _start_once(self, timeout: float) -> "RayCluster":
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        self.log = open(self.temp / "ray-start.log", "wb")
        self.process = subprocess.Popen(
            [shutil.which("ray") or "ray", "start", "--head", "--block", "--port", str(self.port),
             "--node-ip-address", "127.0.0.1", "--num-cpus", str(self.cpus), "--num-gpus", "0",
             "--temp-dir", str(self.temp), "--include-dashboard", "false", "--disable-usage-stats",
             "--object-store-memory", "100000000", "--dashboard-port", str(free_port()),
             "--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port()),
             "--min-worker-port", "0", "--max-worker-port", "0"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        favour(self.process)

        def started() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited {self.process.returncode}:\n{self.output()}")
            return "Ray runtime started" in self.output()

        wait_until(started, timeout, "ray start came up (\"Ray runtime started\")", every=0.5, detail=self.output)
        return self

    def add_node(self, cpus: int) -> subprocess.Popen:
        """A second Ray node of this cluster, on this machine (a raylet of its own): stop it with SIGTERM."""
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        node = subprocess.Popen(
            [shutil.which("ray") or "ray", "start", "--address", self.address, "--block", "--node-ip-address",
             "127.0.0.1", "--num-cpus", str(cpus), "--num-gpus", "0", "--object-store-memory", "100000000",
             "--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port()),
             "--min-worker-port", "0", "--max-worker-port", "0", "--disable-usage-stats"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        favour(node)
        self.nodes.append(node)
        return node

    def alive_nodes(self) -> int:
        """How many of the cluster's nodes are up (asked by a driver of its own: this process stays Ray-free)."""
        script = (f"import ray; ray.init(address={self.address!r}, logging_level='ERROR'); "
                  "print(sum(1 for n in ray.nodes() if n['Alive']))")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        last = (done.stdout.strip().splitlines() or [""])[-1]
        return int(last) if last.isdigit() else 0  # (not answering yet)

    def output(self) -> str:
        try:
            return (self.temp / "ray-start.log").read_text(errors="replace")
        except OSError:
            return ""

    def ray_logs(self, lines: int = 15) -> str:
        """The last lines of the head's raylet and agent logs: why a start failed."""
        logs = self.temp / "session_latest" / "logs"
        parts = []
        for name in ("raylet.out", "raylet.err", "dashboard_agent.err", "runtime_env_agent.err", "gcs_server.err"):
            try:
                tail = (logs / name).read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if tail:
                parts.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster (the ``ray start`` process's session)."""
        found = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if self.process is not None and os.getsid(proc.pid) == self.process.pid:
                    found.append(proc)
            except (ProcessLookupError, PermissionError):
                continue
        return found

    def stop_node(self, node: subprocess.Popen) -> None:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
        self.nodes.remove(node)

    def stop(self) -> None:
        for node in list(self.nodes):
            self.stop_node(node)
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                pass
        if self.process is not None:  # anything of its session still there
            for proc in self.processes():
                try:
                    proc.kill()
                except psutil.Error:
                    pass
        self.log.close() if hasattr(self, "log") else None
        shutil.rmtree(self.temp, ignore_errors=True)


def favour(process: subprocess.Popen) -> None:
    """Give a cluster node's session a larger share of the CPU, so that it comes up under load.

    With autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) each session gets an
    equal share of the CPU, whatever its processes' nice values. On a 2-core machine whose other
    test lane runs a dozen rank sessions, Ray's Python agents then start so slowly that the raylet
    misses the 30 s Ray allows it to register (measured here: ~33 s to come up beside 8 busy
    sessions, ~7 s with the session's autogroup at nice -10). Lowering an autogroup's nice needs
    root; elsewhere this changes nothing.
    """
    try:
        with open(f"/proc/{process.pid}/autogroup", "w") as autogroup:
            autogroup.write("-10")
    except OSError:
        pass


def actor_processes() -> list[psutil.Process]:
    """Live processes of nbddp's rank actors (on any local cluster)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "name"]):
        try:
            if any(ACTOR_TITLE in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found
