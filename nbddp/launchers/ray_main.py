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
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from nbddp.contracts.atomic import write_json
from nbddp.engines.torch import torchrun_variables
from nbddp.contracts.rundir import RunDir
from nbddp.contracts.status import signal_exit_code
from nbddp.contracts.process_groups import stop_groups
from nbddp.launchers.ray import CLUSTER_FAILED, FORWARDED, RANK_GRACE
from nbddp.plan.options import RAY_AUTO, RayRequest
from nbddp.contracts.rank_env import threads_per_rank
from nbddp.contracts.interpreter import module_argv, program_argv

#: Seconds between checks of the ranks (a failure stops the others this soon).
POLL_SECONDS = 0.2
#: Seconds the placed actors have to start and answer (a runtime env to set up, a worker to start).
ACTORS_START_SECONDS = 120.0
RAY_CLIENT_PORT = 10001


class RankActor:
    """One rank's process on its node. ``stop`` runs beside ``run`` (``max_concurrency=2``, in no set
    order: a ``stop`` first means ``run`` starts nothing). The rank is started through
    :mod:`~nbddp.rank_side.parent_death`, armed before the script runs, so it dies with its actor
    even before it imports torch."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.stopped = False

    def where(self, paths: list[str]) -> dict[str, Any]:
        """This actor's node, IP, GPUs, a free port, and which of ``paths`` it can't see."""
        import ray

        from nbddp.contracts.ports import free_port

        port = free_port("")
        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "port": port,
                "missing": [p for p in paths if not os.path.exists(p)]}

    def run(self, argv: list[str], env: dict[str, str], cwd: str, log: str) -> int:
        """The rank's exit code (``-N``: killed by signal N), once it has ended."""
        os.makedirs(os.path.dirname(log), exist_ok=True)
        env = {**os.environ, **env}
        if not env.get("OMP_NUM_THREADS"):  # as nbddp sets it locally (Ray set 1: one CPU per actor)
            env["OMP_NUM_THREADS"] = threads_per_rank(int(env["LOCAL_WORLD_SIZE"]))
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:  # the rank's output before it redirects its own (an import error) lands in its log too
            with self.lock:
                if self.stopped:
                    return -signal.SIGTERM
                self.proc = subprocess.Popen(
                    module_argv("nbddp.rank_side.parent_death", str(os.getpid()), "--", *program_argv(argv)),
                    env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True)
        finally:
            os.close(fd)
        return self.proc.wait()

    def stop(self, sig: int, grace: float) -> int | None:
        """Stop the rank (``sig``, SIGKILL after ``grace`` seconds) and return its exit code once it is gone."""
        with self.lock:
            self.stopped = True
            proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:  # (the rank leads a session of its own: its group is its pid)
            stop_groups([proc.pid], sig, grace, reap=proc.poll)
        return proc.wait()


def answers(address: str, timeout: float = 10.0) -> bool:
    """Whether something accepts connections at ``HOST:PORT`` (or ``ray://HOST[:PORT]``)."""
    import socket

    host, _, port = host_port(address).rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def host_port(address: str) -> str:
    """``HOST:PORT`` of a cluster's address (Ray Client's port is 10001 unless given)."""
    if address.startswith("ray://"):
        rest = address.removeprefix("ray://")
        return rest if re.search(r":\d+$", rest) else f"{rest}:{RAY_CLIENT_PORT}"
    return address


def resolved_address(address: str) -> str | None:
    """The address ``ray.init(address)`` will connect to (``auto``: ``RAY_ADDRESS``, else the cluster Ray finds
    on this machine, else the last one started here); ``None`` when Ray can't tell before connecting."""
    if address != RAY_AUTO:
        return address
    try:  # Ray's own lookup (a private function: when it moves, ray.init does the lookup alone)
        from ray._private.services import get_ray_address_from_environment

        found = get_ray_address_from_environment(RAY_AUTO, None)
    except Exception:  # noqa: BLE001 - none found (ray.init says so), or the function moved
        return None
    return found if found and found != RAY_AUTO else None


def first_line(exc: BaseException) -> str:
    """An exception as one line for the user: its type and the first line of its message (Ray's run long)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def say(text: str) -> None:
    """One line of the cluster's side of the run (streamed as ``[launcher] ray: ...``)."""
    print(f"ray: {text}", flush=True)


class Driver:
    """One run's Ray job: placement, ranks, stop, record."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = RunDir(Path(args.run_dir).resolve())
        self.stopping: list[int] = []
        self.started = time.monotonic()
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

    def stopped_unplaced(self, state: str, short: str) -> int:
        """Stopped (``--timeout``, Ctrl-C, ``nbddp kill``) before the ranks were placed: what the cluster hadn't done
        is the run's ending, whether it was still connecting, about to ask, or waiting for room."""
        waited = time.monotonic() - self.started
        why = short or ("the run was stopped while still connecting to the cluster" if state == "CONNECTING"
                        else "its resources were in use")
        self.write(ended_by=f"Ray: the cluster never placed {self.asked} in the {waited:.0f} s the run waited "
                            f"({state}): {why}")
        return self.stopped()

    def stopped(self) -> int:
        if self.record.get("state") != "WORKER_LOST":  # (what the cluster did stays the record's ending)
            self.write(state="STOPPED")
        return signal_exit_code(self.stopping[0])

    def listen(self) -> None:
        """A stop becomes ``self.stopping``, looked at between the driver's steps."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.on_signal)

    def main(self) -> int:
        self.listen()  # (a stop while Ray imports is kept, not a traceback)
        self.run_dir.ray_job.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        try:
            import ray
        except ImportError:
            return self.fail("Ray isn't installed in this Python: pip install 'nbddp[ray]'.", "FAILED")
        cluster = RayRequest(self.args.address).where()
        advice = "Start one (ray start --head), or give its address: --ray HOST:PORT (ray://HOST:PORT for Ray Client)."
        target = resolved_address(self.args.address)
        if target is not None and not answers(target):  # (ray.init would retry for ever)
            found = f" (--ray alone: {cluster})" if self.args.address == RAY_AUTO else ""
            return self.fail(f"no Ray cluster answers at {host_port(target)}{found}: nothing listens there. {advice}",
                             "UNREACHABLE")
        if self.stopping:
            return self.stopped_unplaced("CONNECTING", "")
        try:
            ray.init(address=self.args.address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
        except SystemExit as exc:  # Ray's own SIGTERM handler, while connecting: sys.exit(signum)
            self.stopping.append(exc.code if isinstance(exc.code, int) and exc.code > 0 else signal.SIGTERM)
            self.listen()
            ray.shutdown()  # (whatever ray.init had connected)
            return self.stopped_unplaced("CONNECTING", "")
        except ConnectionError as exc:
            return self.fail(f"no Ray cluster to connect to ({cluster}): {first_line(exc)} {advice}", "UNREACHABLE")
        except Exception as exc:  # noqa: BLE001 - a version mismatch, a bad address: Ray's words, said as such
            return self.fail(f"connecting to {cluster} failed: {first_line(exc)} (Ray here is {ray.__version__}; it "
                             "must be the cluster's version, with the same Python.)", "UNREACHABLE")
        self.listen()  # again: ray.init sets its own
        try:
            return self.run(ray)
        except ray.exceptions.RayError as exc:  # the cluster went away under the run, or refused it
            return self.fail(f"the cluster failed the run: {first_line(exc)}", "FAILED")
        finally:
            ray.shutdown()

    def run(self, ray: Any) -> int:
        from ray.util.placement_group import placement_group, remove_placement_group

        context = ray.get_runtime_context()
        job_id, address = context.get_job_id(), getattr(context, "gcs_address", None) or self.args.address
        self.write(job_id=job_id, address=address, state="PENDING")
        say(f"job {job_id} on the cluster at {address}: {self.asked}")
        short = self.shortfall(ray)
        if self.stopping:
            return self.stopped_unplaced("not yet asked for", short)
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
            if self.stopping:
                return self.stopped_unplaced(state, short)
            if time.monotonic() - started > self.args.start_timeout:
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
        asked = [a.where.remote([str(self.run_dir.path), script, cwd]) for node in actors for a in node]
        seen = self.gather(ray, asked, "the placed actors to start")
        if seen is None:
            return self.stopped() if self.stopping else CLUSTER_FAILED
        where = [seen[n * args.nproc:(n + 1) * args.nproc] for n in range(args.nodes)]
        missing = sorted({(w["ip"], p) for node in where for w in node for p in w["missing"]})
        if missing:
            ip, path = missing[0]
            return self.fail(f"node {ip} can't see {path}: the run dir, the script and the notebook's folder must be "
                             "on storage every node of the cluster reaches (give --run-dir on one).", "FAILED")
        forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED)}
        order = node_order(where, ray.get_runtime_context().get_node_id())
        plan = rank_plan(where, order, args.gpus, forwarded)
        nodes = [where[n][0] for n in order]
        ips = [info["ip"] for info in nodes]
        say("running on " + ", ".join(
            f"{ip}" + (f" [node {nodes[n]['node'][:8]}]" if ips.count(ip) > 1 else "")
            + (f" (ranks {n * args.nproc}-{(n + 1) * args.nproc - 1})" if args.nproc > 1 else f" (rank {n})")
            for n, ip in enumerate(ips)))
        self.write(state="RUNNING", nodes=[{"ip": info["ip"], "node_id": info["node"]} for info in nodes])
        if self.stopping:
            return self.stopped()
        refs: dict[Any, int] = {}
        rank_actor: dict[int, Any] = {}
        for node, index, rank, env in plan:
            actor = actors[node][index]
            refs[actor.run.remote([script], env, cwd, str(self.run_dir.rank_log(rank)))] = rank
            rank_actor[rank] = actor
        return self.watch(ray, refs, rank_actor)

    def gather(self, ray: Any, refs: list[Any], what: str) -> list[Any] | None:
        """``ray.get(refs)``, but stoppable and bounded: ``None`` when stopped or failed (recorded)."""
        deadline = time.monotonic() + ACTORS_START_SECONDS
        pending = list(refs)
        while pending and not self.stopping:
            if time.monotonic() > deadline:
                self.fail(f"{what} didn't answer within {ACTORS_START_SECONDS:g} s; nothing was trained.", "FAILED")
                return None
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
        if self.stopping:
            return None
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as exc:
            self.fail(f"{what} failed: {first_line(exc)}; nothing was trained.", "FAILED")
            return None

    def watch(self, ray: Any, refs: dict[Any, int], rank_actor: dict[int, Any]) -> int:
        codes: dict[int, int] = {}
        lost: list[str] = []
        while refs and not self.stopping and not any(codes.values()):
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=POLL_SECONDS)
            for ref in done:
                rank = refs.pop(ref)
                try:
                    codes[rank] = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:  # the actor is there, but couldn't start the rank
                    codes[rank] = 1
                    lost.append(f"rank {rank} couldn't start on its node: {first_line(exc.cause or exc)}")
                except ray.exceptions.RayError as exc:  # the actor, its worker process, or its node is gone
                    codes[rank] = -signal.SIGKILL
                    lost.append(f"rank {rank}'s Ray worker was lost ({first_line(exc)})")
                if lost and self.record.get("state") != "WORKER_LOST":
                    say(lost[0])  # recorded at once: nbddp may stop this driver before the others are gone
                    self.write(state="WORKER_LOST", ended_by=f"Ray: {lost[0]}; every other rank was stopped.")
                say(f"rank {rank} exitcode {codes[rank]}")
        if refs:  # stopped, or a rank failed: stop the others, as torchrun does, and see them gone
            stops = {rank_actor[rank].stop.remote(signal.SIGTERM, RANK_GRACE): rank for rank in refs.values()}
            done, _ = ray.wait(list(stops), num_returns=len(stops), timeout=RANK_GRACE + 20)
            for ref, rank in stops.items():
                try:
                    code = ray.get(ref) if ref in done else None
                except ray.exceptions.RayError:
                    code = None
                codes[rank] = -signal.SIGTERM if code is None else code
                say(f"rank {rank} exitcode {codes[rank]}")
        if self.stopping:
            return self.stopped()
        if lost:
            return 1
        failed = any(codes.values())
        self.write(state="FAILED" if failed else "SUCCEEDED")
        return 1 if failed else 0


def gpu_order(gpu: str) -> tuple[bool, int, str]:
    """Numeric GPU ids in number order (``10`` after ``9``), then any others (UUIDs) by name."""
    return (not gpu.isdigit(), int(gpu) if gpu.isdigit() else 0, gpu)


def node_order(where: list[list[dict[str, Any]]], here: str) -> list[int]:
    """The placed nodes in node-rank order: the driver's node (``here``) first when the run has one there,
    so rank 0, which writes the weights, runs beside the kernel."""
    return sorted(range(len(where)), key=lambda n: where[n][0]["node"] != here)


def rank_plan(where: list[list[dict[str, Any]]], order: list[int], gpus: bool,
              forwarded: dict[str, str]) -> list[tuple[int, int, int, dict[str, str]]]:
    """``(node, actor, rank, env)`` for every rank: torchrun's variables for the actor ``where[node][actor]``.

    ``where``: what each node's actors said (:meth:`RankActor.where`), in placement order; ``order``: the
    nodes in node-rank order (:func:`node_order`). With GPUs, a node's ranks are ordered by their GPU id and
    ``CUDA_VISIBLE_DEVICES`` lists the node's GPUs in that order: ``LOCAL_RANK`` is then the index of the
    rank's own GPU (``torch.cuda.set_device(local_rank)``). ``forwarded``: the kernel's variables the ranks get
    (:data:`~nbddp.launchers.ray.FORWARDED`); without ``OMP_NUM_THREADS`` among them, the actor sets it as
    nbddp does locally (the node's CPUs over its ranks; Ray would set 1).
    """
    nproc, nnodes = len(where[0]), len(where)
    master, port = where[order[0]][0]["ip"], where[order[0]][0]["port"]
    plan = []
    for node_rank, node in enumerate(order):
        actors = list(range(nproc))
        if gpus:
            actors.sort(key=lambda a: [gpu_order(g) for g in where[node][a]["gpus"]])
        visible = [g for a in actors for g in where[node][a]["gpus"]]
        for local, actor in enumerate(actors):
            rank = node_rank * nproc + local
            env = {"OMP_NUM_THREADS": "", **forwarded,
                   **torchrun_variables(rank, local, nproc, nnodes, node_rank, (master, port), run_id="nbddp-ray"),
                   **({"CUDA_VISIBLE_DEVICES": ",".join(visible)} if gpus else {})}
            plan.append((node, actor, rank, env))
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbddp.launchers.ray_main",
                                     description="Run SCRIPT's ranks on a Ray cluster (what nbddp run --ray starts).")
    parser.add_argument("--address", default=RAY_AUTO)
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
