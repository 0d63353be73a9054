"""``python -m nbddp.launchers.ray_main RUN_DIR SCRIPT``: a job's ranks on a Ray cluster, watched to the end.

The Ray driver of one run (:mod:`nbddp.launchers.ray` says why Ray Core). It connects to the
cluster, asks it for one placement group (one bundle per node: ``--nproc`` CPUs, or GPUs, each; one
node per bundle), starts one :class:`RankActor` per rank in it, and each actor runs SCRIPT as a
subprocess with torchrun's variables (``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``...), so the rank side
is the same as under torchrun.

It stands in for the job on this machine, so the rest of nbddp owns it like any local launcher:

* its output (``logs/launcher.log``, streamed) is the cluster's side: ``ray: ...`` lines for the job's
  id, the placement group waiting for resources, the nodes the ranks run on, each rank's exit code;
* ``RUN_DIR/ray/job.json`` records the Ray job (id, address, nodes, state) and, when the cluster
  ended the run (resources that never came, a lost worker, no cluster), why, for ``result.json``;
* a rank that fails stops the others (as torchrun does) and the driver exits 1; SIGTERM, SIGINT or
  SIGHUP (Ctrl-C, ``--timeout``, the stop button, ``nbddp kill``, the parent dying) stop every rank
  through its actor (SIGTERM, then SIGKILL after :data:`~nbddp.launchers.ray.RANK_GRACE`), kill the
  actors and remove the placement group before it exits ``128 + signal``. Were the driver itself
  killed, Ray ends the actors it owns and each rank's parent-death signal ends the rank.

``ray`` is imported here only, never by ``import nbddp``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from nbddp.atomic import write_json
from nbddp.job.rundir import RunDir
from nbddp.launchers.ray import CLUSTER_FAILED, RANK_GRACE

#: Seconds between checks of the ranks (a failure stops the others this soon).
POLL_SECONDS = 0.2


class RankActor:
    """One rank's process on its node. ``stop`` runs beside ``run`` (``max_concurrency=2``), and the rank
    is ``run``'s thread's child, so its parent-death signal (set by the rank) fires when the actor dies."""

    def where(self, paths: list[str]) -> dict[str, Any]:
        """This actor's node, IP, GPUs, a free port, and which of ``paths`` it can't see."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "port": port,
                "missing": [p for p in paths if not os.path.exists(p)]}

    def run(self, argv: list[str], env: dict[str, str], cwd: str, log: str) -> int:
        """The rank's exit code (``-N``: killed by signal N), once it has ended."""
        os.makedirs(os.path.dirname(log), exist_ok=True)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:  # the rank's output before it redirects its own (an import error) lands in its log too
            self.proc = subprocess.Popen([sys.executable, *argv], env={**os.environ, **env}, cwd=cwd,
                                         stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True)
        finally:
            os.close(fd)
        return self.proc.wait()

    def stop(self, sig: int, grace: float) -> int | None:
        """Stop the rank (``sig``, SIGKILL after ``grace`` seconds) and return its exit code once it is gone."""
        proc = getattr(self, "proc", None)
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
                return proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return proc.wait()


def answers(address: str, timeout: float = 10.0) -> bool:
    """Whether something accepts connections at ``HOST:PORT`` (or ``ray://HOST:PORT``)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def say(text: str) -> None:
    print(f"ray: {text}", flush=True)


class Driver:
    """One run's Ray job: placement, ranks, stop, record."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = RunDir(Path(args.run_dir).resolve())
        self.stopping: list[int] = []
        self.record: dict[str, Any] = {"address": args.address, "job_id": None, "state": "CONNECTING", "nodes": []}
        per_node = {"CPU": float(args.nproc)} | ({"GPU": float(args.nproc)} if args.gpus else {})
        self.bundles = [per_node] * args.nodes
        self.world = args.nodes * args.nproc
        self.asked = (f"{args.nodes} node{'s' * (args.nodes != 1)} × {args.nproc} "
                      + ("GPU" if args.gpus else "CPU") + f" rank{'s' * (args.nproc != 1)}")

    def on_signal(self, signum: int, frame: object) -> None:
        self.stopping.append(signum)

    def write(self, **changes: Any) -> None:
        self.record.update(changes)
        write_json(self.run_dir.ray_job, self.record)

    def fail(self, why: str, state: str) -> int:
        """The cluster, not the training, ended the run."""
        say(why)
        self.write(state=state, ended_by=f"Ray: {why}")
        return CLUSTER_FAILED

    def stopped(self) -> int:
        self.write(state="STOPPED")
        return 128 + self.stopping[0]

    def main(self) -> int:
        self.run_dir.ray_job.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        try:
            import ray
        except ImportError:
            return self.fail("Ray isn't installed in this Python: pip install 'nbddp[ray]'.", "FAILED")
        given = os.environ.get("RAY_ADDRESS") if self.args.address == "auto" else self.args.address
        where = f"{given}" + (" (RAY_ADDRESS)" if self.args.address == "auto" and given else "") if given \
            else "this machine (no RAY_ADDRESS, and no `ray start` here)"
        unreachable = f"no Ray cluster answers at {where}"
        advice = "Start one (ray start --head), or give its address: --ray HOST:PORT (ray://HOST:PORT for Ray Client)."
        if given and given != "auto" and not answers(given):  # (ray.init would retry for ever)
            return self.fail(f"{unreachable}: nothing listens on {given.removeprefix('ray://')}. {advice}", "UNREACHABLE")
        try:
            ray.init(address=self.args.address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            return self.fail(f"{unreachable}: {str(exc).strip().splitlines()[0]} {advice}", "UNREACHABLE")
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # after ray.init, which sets its own
            signal.signal(sig, self.on_signal)
        try:
            return self.run(ray)
        finally:
            ray.shutdown()

    def run(self, ray: Any) -> int:
        from ray.util.placement_group import placement_group, remove_placement_group

        context = ray.get_runtime_context()
        job_id, address = context.get_job_id(), getattr(context, "gcs_address", None) or self.args.address
        self.write(job_id=job_id, address=address, state="PENDING")
        say(f"job {job_id} on the cluster at {address}: {self.asked}")
        if self.stopping:
            return self.stopped()
        short = self.shortfall(ray)
        if short:
            say(f"{short}: waiting up to {self.args.start_timeout:g} s (--rdzv-timeout) for the cluster to grow")
        group = placement_group(self.bundles, strategy="STRICT_SPREAD" if len(self.bundles) > 1 else "PACK")
        try:
            placed = self.wait_placed(ray, group, short)
            if placed is not None:
                return placed
            return self.train(ray, group)
        finally:
            remove_placement_group(group)

    def shortfall(self, ray: Any) -> str:
        """Why the cluster as it is now can never hold the ranks (``""``: it can, once they are free)."""
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        fit = sum(all(node.get(key, 0.0) >= need for key, need in self.bundles[0].items()) for node in nodes)
        if fit >= len(self.bundles):
            return ""
        have = ", ".join(f"{sum(node.get(key, 0.0) for node in nodes):g} {key}" for key in self.bundles[0])
        return (f"the cluster's {len(nodes)} node{'s' * (len(nodes) != 1)} ({have} in all) can't hold {self.asked}: "
                f"{fit} node{'s' * (fit != 1)} ha{'ve' if fit != 1 else 's'} "
                + " and ".join(f"{need:g} {key}" for key, need in self.bundles[0].items()) + " to give")

    def wait_placed(self, ray: Any, group: Any, short: str) -> int | None:
        """Wait until the cluster placed every bundle; an exit code when it never did (or we were stopped)."""
        from ray.util.placement_group import placement_group_table

        started, shown = time.monotonic(), ""
        while not group.wait(1):
            table = placement_group_table(group)
            state = (table.get("stats") or {}).get("scheduling_state") or table.get("state") or "PENDING"
            line = f"waiting for the cluster to place {self.asked} ({state})"
            if line != shown:
                say(line)
                shown = line
            waited = time.monotonic() - started
            if self.stopping:
                self.write(ended_by=f"Ray: the cluster never placed {self.asked} in the {waited:.0f} s the run "
                                    f"waited ({state}): " + (short or "its resources were in use"))
                return self.stopped()
            if waited > self.args.start_timeout:
                return self.fail(f"the cluster never placed {self.asked} within --rdzv-timeout "
                                 f"{self.args.start_timeout:g} s ({state}): "
                                 + (short or "its resources stayed in use by other work") + ". Nothing was trained.",
                                 "NEVER_PLACED")
        return None

    def train(self, ray: Any, group: Any) -> int:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        args = self.args
        actor_class = ray.remote(max_concurrency=2)(RankActor)
        actors = [[actor_class.options(num_cpus=1, num_gpus=1 if args.gpus else 0,
                                       scheduling_strategy=PlacementGroupSchedulingStrategy(
                                           placement_group=group, placement_group_bundle_index=node)).remote()
                   for _ in range(args.nproc)] for node in range(args.nodes)]
        try:
            return self.run_ranks(ray, actors)
        finally:
            for actor in (a for node in actors for a in node):
                ray.kill(actor)

    def run_ranks(self, ray: Any, actors: list[list[Any]]) -> int:
        args = self.args
        script, cwd = str(Path(args.script).resolve()), str(Path(args.cwd).resolve())
        seen = ray.get([a.where.remote([str(self.run_dir.path), script, cwd]) for node in actors for a in node])
        where = [seen[n * args.nproc:(n + 1) * args.nproc] for n in range(args.nodes)]
        here = ray.get_runtime_context().get_node_id()  # the driver's node first: rank 0 beside the kernel
        order = sorted(range(args.nodes), key=lambda n: where[n][0]["node"] != here)
        actors, where = [actors[n] for n in order], [where[n] for n in order]
        missing = sorted({(w["ip"], p) for node in where for w in node for p in w["missing"]})
        if missing:
            ip, path = missing[0]
            return self.fail(f"node {ip} can't see {path}: the run dir, the script and the notebook's folder must be "
                             "on storage every node of the cluster reaches (give --run-dir on one).", "FAILED")
        nodes = [node[0]["ip"] for node in where]
        master, port = nodes[0], where[0][0]["port"]
        say("running on " + ", ".join(
            f"{ip}" + (f" [node {where[n][0]['node'][:8]}]" if nodes.count(ip) > 1 else "")
            + (f" (ranks {n * args.nproc}-{(n + 1) * args.nproc - 1})" if args.nproc > 1 else f" (rank {n})")
            for n, ip in enumerate(nodes)))
        self.write(state="RUNNING", nodes=[{"ip": ip, "node_id": where[n][0]["node"]} for n, ip in enumerate(nodes)])
        shared = {k: v for k, v in os.environ.items() if k.startswith("NBDDP_")}
        refs: dict[Any, int] = {}
        rank_actor: dict[int, Any] = {}
        for n, node in enumerate(where):
            pairs = list(zip(actors[n], node))
            if args.gpus:  # local rank = the index of the rank's GPU among the node's (torch.cuda.set_device)
                pairs.sort(key=lambda pair: [int(g) if g.isdigit() else g for g in pair[1]["gpus"]])
            gpus = [g for _, info in pairs for g in info["gpus"]]
            for local, (actor, info) in enumerate(pairs):
                rank = n * args.nproc + local
                env = {**shared, "RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(local),
                       "LOCAL_WORLD_SIZE": str(args.nproc), "GROUP_RANK": str(n), "GROUP_WORLD_SIZE": str(args.nodes),
                       "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.world), "MASTER_ADDR": master,
                       "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                       "PYTHONUNBUFFERED": "1", **({"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if args.gpus else {})}
                refs[actor.run.remote([script], env, cwd,
                                      str(self.run_dir.rank_log(rank)))] = rank
                rank_actor[rank] = actor
        return self.watch(ray, refs, rank_actor)

    def watch(self, ray: Any, refs: dict[Any, int], rank_actor: dict[int, Any]) -> int:
        codes: dict[int, int] = {}
        lost: list[str] = []
        while refs and not self.stopping and not any(codes.values()):
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=POLL_SECONDS)
            for ref in done:
                rank = refs.pop(ref)
                try:
                    codes[rank] = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the actor, its worker process, or its node is gone
                    codes[rank] = -signal.SIGKILL
                    lost.append(f"rank {rank}'s Ray worker was lost ({type(exc).__name__}: "
                                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'no detail'})")
                    say(lost[-1])
                say(f"rank {rank} exitcode {codes[rank]}")
        if refs:  # stopped, or a rank failed: stop the others, as torchrun does, and see them gone
            stops = {rank: rank_actor[rank].stop.remote(signal.SIGTERM, RANK_GRACE) for rank in refs.values()}
            for rank, ref in stops.items():
                try:
                    code = ray.get(ref, timeout=RANK_GRACE + 20)
                except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                    code = None
                codes[rank] = -signal.SIGTERM if code is None else code
                say(f"rank {rank} exitcode {codes[rank]}")
        if lost and not self.stopping:
            self.write(state="WORKER_LOST", ended_by=f"Ray: {lost[0]}; every other rank was stopped.")
            return 1
        if self.stopping:
            return self.stopped()
        failed = any(codes.values())
        self.write(state="FAILED" if failed else "SUCCEEDED")
        return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbddp.launchers.ray_main",
                                     description="Run SCRIPT's ranks on a Ray cluster (what nbddp run --ray starts).")
    parser.add_argument("--address", default="auto")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--nproc", type=int, required=True, help="ranks per node")
    parser.add_argument("--gpus", action="store_true", help="one GPU per rank")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for the resources")
    parser.add_argument("--cwd", default=os.getcwd(), help="the ranks' working folder (the notebook's)")
    parser.add_argument("run_dir")
    parser.add_argument("script")
    driver = Driver(parser.parse_args(argv))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # until ray.init replaces them
        signal.signal(sig, driver.on_signal)
    return driver.main()


if __name__ == "__main__":
    sys.exit(main())
