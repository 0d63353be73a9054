"""Each check's body, run in a subprocess of its own: ``python -m nbddp.doctor.checks NAME`` reads the
:class:`~nbddp.doctor.ask.Ask` on its stdin and prints the :class:`~nbddp.doctor.verdict.Verdict` as JSON.

A subprocess each, because what a check touches can hang or crash a process: a driver that stops answering NVML, a
CUDA initialisation, an all-reduce, a name that never resolves. :mod:`nbddp.doctor.examine` gives each its time limit
and kills what outlives it. The needs counted here are rules of thumb, named in the line they judge by, so a user can
see what was assumed: ``/dev/shm`` and the open files scale with the ranks and their DataLoader workers.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import socket
import sys
import tempfile
from pathlib import Path
from typing import Callable

from nbddp.contracts.devices import driver_version, gpu_usage, requested_gpus, visible_gpu_count, visible_usage
from nbddp.contracts.owned import NotYours, check_owned
from nbddp.contracts.ports import free_port
from nbddp.doctor.ask import Ask
from nbddp.doctor.verdict import Verdict, ok, problem, skipped

#: ``/dev/shm`` each DataLoader worker (a worker's prefetched batches pass through it) and each GPU rank (NCCL's
#: shared-memory transport keeps its buffers there) may fill (PyTorch's docker advice: ``--shm-size``, ``--ipc=host``).
SHM_PER_PROCESS = 64 * 2**20
#: Open files a rank holds for itself and for each of its workers: DataLoader workers hand tensors over as file
#: descriptors, which the rank holds until it has read them.
FILES_PER_PROCESS = 64
#: Fewer open files than this is too few for any Python program with sockets and logs.
FILES_FLOOR = 1024
#: Locked memory NCCL needs to register its network buffers (InfiniBand/RoCE, GPUDirect): its docs ask for
#: ``unlimited``; below this, registration fails.
MEMLOCK_NEED = 64 * 2**20
#: Where Linux lists InfiniBand and RoCE devices: NCCL registers its buffers with them within the memlock limit.
INFINIBAND = Path("/sys/class/infiniband")
#: Seconds a cluster's endpoint gets to answer a connection.
DIAL_SECONDS = 5.0
#: Seconds Slurm's ``sinfo`` gets to answer (it retries for a minute when the controller is down).
SINFO_SECONDS = 10.0


def versions(ask: Ask) -> Verdict:
    """Python, torch, CUDA, NCCL and the driver; that this torch can use the devices the run asks for."""
    found: dict[str, object] = {"python": platform.python_version(), "driver": driver_version()}
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        return problem("versions", f"torch can't be imported ({type(exc).__name__}: {exc})", "no rank can start",
                       "pip install torch (a build for this machine's CUDA where it has GPUs)", **found)
    found.update(torch=torch.__version__, cuda=torch.version.cuda)
    said = f"Python {found['python']}, torch {torch.__version__}"
    if not dist.is_available():
        return problem("versions", f"torch {torch.__version__} was built without torch.distributed",
                       "no DDP run can start", "install PyPI's torch (pip install torch)", **found)
    if ask.kind != "cuda":
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
        return ok("versions", f"{said} ({build}), gloo {'available' if dist.is_gloo_available() else 'missing'}",
                  **found)
    if torch.version.cuda is None:
        return problem("versions", f"torch {torch.__version__} is a CPU build, and this machine shows GPUs "
                       f"(driver {found['driver']})", "a run can't use the GPUs",
                       "pip install torch built for CUDA (https://pytorch.org/get-started/locally/), or --cpu", **found)
    if not torch.cuda.is_available():
        return problem("versions", f"torch {torch.__version__} (CUDA {torch.version.cuda}) can't use the GPUs of "
                       f"driver {found['driver']}", "every GPU run fails as it starts",
                       "a torch built for a CUDA this driver supports (nvidia-smi shows its newest), or a newer driver",
                       **found)
    found["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version()) if dist.is_nccl_available() else None
    if found["nccl"] is None:
        return problem("versions", f"torch {torch.__version__} has no NCCL", "GPU runs can't all-reduce",
                       "install PyPI's CUDA build of torch", **found)
    return ok("versions", f"{said}, CUDA {torch.version.cuda}, NCCL {found['nccl']}, driver {found['driver']}",
              **found)


def gpus(ask: Ask) -> Verdict:
    """The GPUs visible against those asked for, and who holds the ones the run would use (NVML)."""
    usage = visible_usage(gpu_usage())
    visible = len(usage) if usage else visible_gpu_count()
    narrowed = " (CUDA_VISIBLE_DEVICES narrows them)" if "CUDA_VISIBLE_DEVICES" in os.environ else ""
    found = {"visible": visible, "gpus": [_gpu(u, ask.own_pid) for u in usage]}
    exit3 = "the run stops before it starts (exit 3)"
    if ask.devices_refused:
        asked = f"--gpus {ask.gpus}"
        if visible == 0:
            return problem("gpus", f"{asked}, and no GPU is visible{narrowed}", exit3,
                           "--cpu to train on the CPU" + (", or unset CUDA_VISIBLE_DEVICES" if narrowed else ""),
                           **found)
        if str(ask.gpus).lower() == "free" or (requested_gpus(ask.gpus or 1) or 0) <= visible:
            return problem("gpus", f"{asked}: no GPU is free ({_holders(usage, ask.own_pid)})", exit3,
                           f"{asked} --wait waits for one, or ask who holds them", **found)
        return problem("gpus", f"{asked}, and {visible} GPU{'s' * (visible != 1)} {'is' if visible == 1 else 'are'} "
                       f"visible{narrowed}", exit3, f"--gpus {visible}, or --cpu", **found)
    if ask.kind != "cuda":
        why = "--cpu" if ask.gpus is None and visible else "no GPU visible"
        return ok("gpus", f"none used ({why}): {ask.nproc} CPU processes (gloo)", **found)
    used = [u for u in usage if u.uuid in ask.gpu_ids] if ask.gpu_ids else usage[:ask.nproc]
    mine = [u for u in used if any(pid == ask.own_pid for pid, _ in u.holders)]
    if mine:
        held = sum(max(b, 0) for u in mine for pid, b in u.holders if pid == ask.own_pid)
        return problem("gpus", f"this kernel (pid {ask.own_pid}) holds {_size(held)} on GPU "
                       f"{', '.join(str(u.index) for u in mine)}: CUDA was initialised in the notebook's own process",
                       "the ranks get that much less memory, and a library that launches its own processes refuses "
                       "to start ('CUDA already initialized')",
                       "keep CUDA out of the kernel until the run (nbddp's ranks never need it there): restart it, or "
                       "del the model and torch.cuda.empty_cache()", **found)
    warm = _descendants(ask.own_pid)  # (a kernel's warm ranks: its own, the next run's)
    kept = [u for u in used if u.holders and all(pid in warm for pid, _ in u.holders)]
    others = [u for u in used if u.busy and u not in kept]
    if others:
        return problem("gpus", f"{_holders(others, ask.own_pid)}", "the run shares their memory and compute: CUDA "
                       "out of memory, or a slow run", "--gpus free (the GPUs nobody uses), --gpus N --wait, or ask "
                       "who holds them", **found)
    theirs = (f"; this kernel's warm ranks hold GPU {', '.join(str(u.index) for u in kept)} (%ddp_ranks stop releases "
              "them)" if kept else "")
    return ok("gpus", f"{visible} visible; the run's {len(used)} ({', '.join(str(u.index) for u in used)}) free"
              + theirs, **found)


def _descendants(pid: int | None) -> set[int]:
    """The processes ``pid`` started, theirs, and so on (``set()`` without one)."""
    if pid is None:
        return set()
    import psutil

    try:
        return {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _gpu(use: object, own_pid: int | None) -> dict[str, object]:
    from dataclasses import asdict

    return {**asdict(use), "holders": [_who(pid, own_pid) | {"bytes": b} for pid, b in use.holders]}  # type: ignore


def _holders(usage: list, own_pid: int | None) -> str:
    """``GPU 1 is in use by pid 4242 (python, alice, 30.1 GiB)``, for each busy GPU of ``usage``."""
    said = []
    for use in usage:
        if not use.busy:
            continue
        who = [_said(_who(pid, own_pid), b) for pid, b in use.holders]
        held = f"{_size(use.used)} of {_size(use.total)} used"
        said.append(f"GPU {use.index} ({held}) is in use by {', '.join(who)}" if who
                    else f"GPU {use.index} has {held} by processes NVML doesn't name (another container's?)")
    return "; ".join(said)


def _who(pid: int, own_pid: int | None) -> dict[str, object]:
    """A process's name and owner, as ``/proc`` says (a pid of another container's: unknown here)."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return {"pid": pid, "name": None, "user": None, "this kernel": False}
    try:
        import pwd

        user = pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        user = str(uid)
    return {"pid": pid, "name": name, "user": user, "this kernel": pid == own_pid}


def _said(who: dict[str, object], held: int) -> str:
    memory = f", {_size(held)}" if held >= 0 else ""
    if who["name"] is None:
        return f"pid {who['pid']} (not a process of this machine's: another container's?{memory})"
    return f"pid {who['pid']} ({who['name']}, {who['user']}{memory})"


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def allreduce(ask: Ask) -> Verdict:
    """One all-reduce attempt (:func:`nbddp.doctor.allreduce.attempt`), its transports as the environment sets
    them; :mod:`nbddp.doctor.examine` judges the attempts."""
    from nbddp.doctor.allreduce import attempt, ranks_for

    result = attempt(ask.backend, ranks_for(ask.kind, ask.nproc), ask.limit, ask.fault)
    return Verdict("allreduce", result["state"], "", result["seconds"], result)


def shm(ask: Ask) -> Verdict:
    """``/dev/shm``'s free space against what the ranks' DataLoader workers (and NCCL's transport) put there."""
    need = shm_need(ask.kind, ask.nproc, ask.workers)
    counted = (f"about {_size(need)} is needed, counting {ask.nproc} rank{'s' * (ask.nproc != 1)} with {ask.workers} "
               "DataLoader workers each")
    breaks = ("DataLoader workers (num_workers > 0) die with 'Bus error' or 'No space left on device'"
              + (", and NCCL's shared-memory transport fails or hangs" if ask.kind == "cuda" else ""))
    try:
        info = os.statvfs("/dev/shm")
    except OSError as exc:
        if need == 0:
            return ok("shm", f"no /dev/shm ({exc.strerror}), and {counted}")
        return problem("shm", f"/dev/shm can't be used ({exc.strerror})", breaks,
                       "mount a tmpfs there (docker run --shm-size=1g, or --ipc=host)")
    size, free = info.f_blocks * info.f_frsize, info.f_bavail * info.f_frsize
    found = {"size": size, "free": free, "need": need}
    if free < need:
        gib = max(1, -(-need // 2**30))
        return problem("shm", f"/dev/shm has {_size(free)} free of {_size(size)}; {counted}", breaks,
                       f"docker run --shm-size={gib}g (or --ipc=host); on a host, mount -o remount,size={gib}G "
                       "/dev/shm; or fewer DataLoader workers per rank", **found)
    return ok("shm", f"/dev/shm has {_size(free)} free; {counted}", **found)


def shm_need(kind: str, nproc: int, workers: int) -> int:
    """What a run's ranks put in ``/dev/shm``, a rule of thumb: :data:`SHM_PER_PROCESS` for each DataLoader worker's
    batches in flight, and for each rank's NCCL buffers on GPUs (gloo's ranks keep none there)."""
    return (nproc * workers + (nproc if kind == "cuda" else 0)) * SHM_PER_PROCESS


def memlock(ask: Ask) -> Verdict:
    """The locked-memory limit NCCL registers its network buffers within (a GPU run's concern, not gloo's)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    found = {"soft": soft, "hard": hard}
    shown = "unlimited" if soft == resource.RLIM_INFINITY else _size(soft)
    if ask.kind != "cuda":
        return ok("memlock", f"{shown} (gloo on the CPU locks no memory)", **found)
    if ask.nodes < 2 and not ask.on_a_cluster:
        return ok("memlock", f"{shown} (NCCL on one machine goes through P2P and shared memory, which lock none)",
                  **found)
    devices = sorted(p.name for p in INFINIBAND.iterdir()) if INFINIBAND.is_dir() else []
    found["infiniband"] = devices
    if not devices:
        return ok("memlock", f"{shown} (no InfiniBand or RoCE device here: NCCL's sockets lock none)", **found)
    if soft != resource.RLIM_INFINITY and soft < MEMLOCK_NEED:
        return problem("memlock", f"locked memory is limited to {shown}, and this machine has InfiniBand/RoCE "
                       f"({', '.join(devices)})",
                       "NCCL can't register its buffers for InfiniBand/RoCE or GPUDirect (ibv_reg_mr fails): runs "
                       "across nodes fail or fall back to slow sockets",
                       "ulimit -l unlimited before starting Jupyter or nbddp (docker run --ulimit memlock=-1; Slurm: "
                       "the limit of slurmd's service)", **found)
    return ok("memlock", shown, **found)


def files(ask: Ask) -> Verdict:
    """The open-files limit (each process's own) against what a rank and its DataLoader workers hold."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max(FILES_FLOOR, (1 + ask.workers) * FILES_PER_PROCESS)
    found = {"soft": soft, "hard": hard, "need": need}
    if soft != resource.RLIM_INFINITY and soft < need:
        fix = (f"ulimit -n {need} before starting Jupyter or nbddp" if hard == resource.RLIM_INFINITY or hard >= need
               else f"raise the hard limit ({hard} here) to {need} or more: docker run --ulimit nofile={need}:{need}, "
                    f"or /etc/security/limits.conf; then ulimit -n {need}")
        return problem("files", f"open files are limited to {soft} a process; a rank with {ask.workers} DataLoader "
                       f"workers needs about {need}",
                       "workers fail with 'Too many open files' or 'received 0 items of ancdata'", fix, **found)
    return ok("files", f"{soft} open files a process (a rank needs about {need})", **found)


def folder(ask: Ask) -> Verdict:
    """The folder runs go in: the user's alone and writable, or creatable."""
    if ask.run_dir and Path(ask.run_dir).is_dir():  # (a run dir given that is there: a run judges it as it is)
        try:
            check_owned(Path(ask.run_dir), "--run-dir", follow=True)
        except NotYours as exc:
            return _not_yours(exc, Path(ask.run_dir))
    path = Path(ask.folder).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if existing == path:
            check_owned(path, "the runs folder", follow=True)
    except NotYours as exc:
        return _not_yours(exc, path)
    if not os.access(existing, os.W_OK | os.X_OK):
        return problem("folder", f"{existing} can't be written by you", "a run can't write its script, logs and "
                       "weights", "--run-dir in a folder of your own", folder=str(path))
    if existing == path:
        try:
            fd, name = tempfile.mkstemp(dir=path, prefix=".nbddp-doctor-")
            os.close(fd)
            os.unlink(name)
        except OSError as exc:
            return problem("folder", f"{path} can't be written ({exc.strerror})", "a run can't write its script, "
                           "logs and weights", "--run-dir in a folder you can write", folder=str(path))
        return ok("folder", f"{path} is yours and writable", folder=str(path))
    return ok("folder", f"{path} will be made (private) in {existing}", folder=str(path))


def _not_yours(exc: NotYours, path: Path) -> Verdict:
    """A folder a run refuses (:mod:`nbddp.contracts.owned`'s judgement), as the ``folder`` check's line."""
    wrong = str(exc).split(": ", 1)[0]
    return problem("folder", wrong, "nbddp refuses to write a run there (exit 2)", "--run-dir in a folder of your own"
                   + (f", or chmod go-w {path}" if "can be written" in wrong else ""), folder=str(path))


def loopback(ask: Ask) -> Verdict:
    """A connection on 127.0.0.1, where a run's ranks on one machine meet."""
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            port = server.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=DIAL_SECONDS) as client:
                accepted, _ = server.accept()
                with accepted:
                    client.sendall(b"nbddp")
                    if accepted.recv(5) != b"nbddp":
                        raise OSError("the bytes sent did not arrive")
    except OSError as exc:
        return problem("loopback", f"127.0.0.1 doesn't answer ({exc})", "the ranks of a run on this machine can't "
                       "meet", "bring the loopback interface up (ip link set lo up)")
    return ok("loopback", "127.0.0.1 answers: a run's ranks on one machine meet there, on a port of this machine alone")


def endpoint(ask: Ask) -> Verdict:
    """Where the nodes meet (``--rdzv-endpoint``), or the cluster (Slurm's controller, Ray's head), answers."""
    if ask.slurm:
        return _slurm(min(ask.limit, SINFO_SECONDS))
    if ask.ray is not None:
        return _ray(ask.ray)
    if ask.nodes < 2:
        return skipped("endpoint", "one machine: no endpoint")
    host, port = ask.host, ask.port
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError as exc:
        return problem("endpoint", f"{host} does not resolve ({exc.strerror or exc})", "the nodes can't meet",
                       "--rdzv-endpoint with node 0's address, or its name in /etc/hosts or DNS", endpoint=ask.endpoint)
    if ask.node_rank == 0:
        return _listens_here(host, port, addresses, ask.endpoint)
    return _answers(host, port, ask.endpoint)


def _listens_here(host: str, port: int, addresses: set[str], given: str) -> Verdict:
    """Node 0: the endpoint is this machine, and its port is free for the store (which listens on every interface)."""
    import psutil

    here = {a.address.split("%")[0] for nic in psutil.net_if_addrs().values() for a in nic}
    if not addresses & here and not any(a.startswith("127.") for a in addresses):  # (Debian names itself 127.0.1.1)
        return problem("endpoint", f"--node-rank 0, but {host} is {', '.join(sorted(addresses))}, none of this "
                       "machine's addresses", "the other nodes would dial another machine: the run never starts",
                       "run node 0 on the machine --rdzv-endpoint names, or name this one", endpoint=given)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the store binds: a closed run's port is free)
        try:
            probe.bind(("", port))
        except OSError as exc:
            holder = _port_holder(port)
            return problem("endpoint", f"port {port} is in use on this machine{holder} ({exc.strerror})",
                           "node 0's rendezvous store can't listen there: the run fails as it starts",
                           f"--rdzv-endpoint {host}:{free_port('')} (free now) on every node", endpoint=given)
    alone = (" (a loopback address: only nodes on this machine can reach it)"
             if all(a.startswith("127.") or a == "::1" for a in addresses) else "")
    return ok("endpoint", f"{given} is this machine, and port {port} is free for the store{alone}", endpoint=given)


def _port_holder(port: int) -> str:
    """`` by pid 4242 (python3, alice)``: who listens on ``port`` (what psutil may see of it)."""
    import psutil

    try:
        pids = {c.pid for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port and c.pid}
    except (psutil.Error, OSError):
        return ""
    said = [_said(_who(pid, None), -1) for pid in sorted(pids)]
    return f" by {', '.join(said)}" if said else ""


def _answers(host: str, port: int, given: str) -> Verdict:
    try:
        with socket.create_connection((host, port), timeout=DIAL_SECONDS):
            pass
    except OSError as exc:
        why = (f"no answer in {DIAL_SECONDS:g} s (a firewall?)" if isinstance(exc, socket.timeout)
               else exc.strerror or str(exc))
        return problem("endpoint", f"node 0's store at {given} does not answer ({why})",
                       "this node can't join: the run waits --rdzv-timeout, then fails",
                       "start node 0's nbddp run first (its store listens once it starts), and check the address, the "
                       "port and any firewall between the nodes", endpoint=given)
    return ok("endpoint", f"node 0's store at {given} answers", endpoint=given)


def _slurm(seconds: float) -> Verdict:
    import subprocess

    from nbddp.contracts.errors import UsageError
    from nbddp.launchers.slurm import require_slurm

    try:
        require_slurm()
    except UsageError as exc:
        return problem("endpoint", str(exc).split(". ")[0].removeprefix("--slurm: "), "--slurm can't submit the run",
                       "run where Slurm's client commands are (a login node)")
    sinfo = subprocess.Popen(["sinfo", "-h", "-o", "%P"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    waited = ""
    try:
        out, err = sinfo.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:  # (sinfo retries a minute before it gives up)
        sinfo.kill()
        out, err = sinfo.communicate()
        waited = f" in {seconds:g} s"
    if sinfo.returncode != 0 or waited:
        said = (err.strip().splitlines() or ["no output"])[-1].removeprefix("sinfo: ")
        return problem("endpoint", f"Slurm's controller does not answer{waited} (sinfo: {said})", "--slurm can't "
                       "submit the run", "check SLURM_CONF and that slurmctld runs (scontrol ping says which "
                       "controller is down; on a login node, ask the cluster's administrators)")
    partitions = " ".join(out.split())
    return ok("endpoint", f"Slurm answers: partitions {partitions}", partitions=partitions)


def _ray(address: str) -> Verdict:
    from nbddp.launchers.ray_main import answers, host_port, resolved_address

    found = resolved_address(address)
    if found is None:
        return problem("endpoint", "no Ray cluster to join: RAY_ADDRESS is unset and none was started on this "
                       "machine", "--ray can't place the ranks", "ray start --head here, or --ray HOST:PORT")
    if not answers(found, DIAL_SECONDS):
        dialled = f" ({host_port(found)})" if host_port(found) != found else ""
        return problem("endpoint", f"the Ray cluster at {found} does not answer{dialled}",
                       "--ray can't place the ranks (the run waits --rdzv-timeout, then fails)",
                       "start it (ray start --head), or give its head's address: --ray HOST:PORT (or "
                       "ray://HOST:PORT for Ray Client)", address=found)
    return ok("endpoint", f"the Ray cluster at {found} answers", address=found)


#: Every check a subprocess runs, by name, in the order they are said.
BODIES: dict[str, Callable[[Ask], Verdict]] = {
    "versions": versions, "gpus": gpus, "allreduce": allreduce, "shm": shm, "memlock": memlock, "files": files,
    "folder": folder, "loopback": loopback, "endpoint": endpoint,
}


def main(argv: list[str]) -> None:
    import signal

    from nbddp.rank_side.parent_death import arm

    arm(signal.SIGKILL)  # (the doctor gone, its checks go too)
    ask = Ask.from_json(sys.stdin.read())
    verdict = BODIES[argv[0]](ask)
    print(json.dumps(verdict.to_dict()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
