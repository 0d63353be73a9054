"""Which devices a run uses, decided before anything starts and without importing torch.

GPUs are counted through NVML (the driver's own library, loaded with ctypes)
narrowed by ``CUDA_VISIBLE_DEVICES``: importing torch only to count GPUs would
cost the launcher a second or more on every run. On a shared GPU server, NVML also says which GPUs
someone else is using (``--gpus free``, ``--wait``): :func:`gpu_usage`, judged by :meth:`GpuUse.busy`.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from nbddp.contracts.errors import DeviceError, UsageError

#: CPU processes (gloo) per node when neither ``--nproc`` nor GPUs say otherwise.
CPU_PROCESSES = 2
#: ``--gpus free``: every GPU nobody else is using.
FREE = "free"
#: A GPU with this share of its memory in use holds someone's work even when NVML lists no process on it
#: (a process of another container, or of another user where the driver hides it).
BUSY_MEMORY = 0.05
#: How often ``--wait`` looks at the GPUs again, and how often it says what it is waiting for.
WAIT_POLL_SECONDS, WAIT_SAY_SECONDS = 5.0, 60.0


@dataclass(frozen=True)
class Devices:
    """What the ranks run on: ``nproc`` processes, on ``cuda`` (one GPU each) or ``cpu`` (gloo)."""

    kind: str
    nproc: int
    note: str = ""
    """One line for the user when the choice was made for them (no GPU visible, the free GPUs chosen)."""
    gpu_ids: tuple[str, ...] = ()
    """The GPUs chosen by name (NVML's UUIDs), when not simply the first visible ones (``--gpus free``,
    ``--wait``): the run's processes see only them (:meth:`environment`)."""

    def describe(self) -> str:
        return _gpus(self.nproc) if self.kind == "cuda" else f"{self.nproc} CPU processes (gloo)"

    def environment(self) -> dict[str, str]:
        """What the run's processes need to see exactly these devices: ``CUDA_VISIBLE_DEVICES`` when GPUs
        were chosen, else nothing (they see what this process sees)."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.gpu_ids)} if self.gpu_ids else {}


def visible_gpu_count(physical: int | None = None) -> int:
    """GPUs this process may use: NVML's count (or ``physical``), narrowed by ``CUDA_VISIBLE_DEVICES``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = _nvml_device_count() if physical is None else physical
    if visible is None:
        return physical
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    count = 0
    for entry in entries:  # CUDA stops at the first invalid entry
        if entry.startswith("-") or (entry.isdigit() and int(entry) >= physical and physical):
            break
        count += 1
    return min(count, physical) if physical else 0


def _nvml_device_count() -> int:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    try:
        if nvml.nvmlInit_v2() != 0:
            return 0
        ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        nvml.nvmlShutdown()
    except AttributeError:
        return 0
    return count.value if ok else 0


def requested_gpus(gpus: str | int) -> int | None:
    """``--gpus`` as a count, ``None`` for ``all`` and ``free`` (as many as there are).

    Raises:
        UsageError: neither a positive number nor ``all`` nor ``free`` (exit 2).
    """
    if str(gpus).lower() in ("all", FREE):
        return None
    try:
        wanted = int(gpus)
    except ValueError:
        raise UsageError(f"--gpus {gpus!r}: give a number, 'all' or 'free'.") from None
    if wanted < 1:
        raise UsageError(f"--gpus {wanted}: need at least 1 GPU (or --cpu).")
    return wanted


def asked_per_node(gpus_per_node: int | None, cpu: bool, nproc: int | None) -> Devices | None:
    """A cluster node's devices when the flags say (``--gpus-per-node G``, ``--cpu``/``--nproc P``), else ``None``
    (each cluster has its own default: Slurm's partition, Ray's 2 CPU processes)."""
    if gpus_per_node is not None:
        return Devices("cuda", gpus_per_node)
    if cpu or nproc is not None:
        return Devices("cpu", nproc or CPU_PROCESSES)
    return None


def notebook_devices(asked: int, cpu: bool = False, visible: int | None = None) -> Devices:
    """The devices of a run whose notebook gives its library a process count as a literal
    (``notebook_launcher(num_processes=2)``, ``Trainer(devices=2)``) when no launch option counts them.

    The literal is what the notebook's author ran with; the notebook must run as shipped on a CPU-only
    machine, on one GPU and on several. On the CPU (``--cpu``, or no GPU visible) it is the number of
    CPU processes; with GPUs, one process per GPU: as many as it asks, or every visible GPU where fewer
    are visible, said in the note (an explicit ``--gpus N``/``--nproc N`` beyond them stays an error,
    :func:`resolve`). Each rank then hands the library the run's count, never the literal
    (:mod:`nbddp.rank_side.frameworks`), so it neither fails nor starts processes of its own.
    """
    visible = 0 if cpu else visible_gpu_count() if visible is None else visible
    if visible == 0:
        return Devices("cpu", asked, note=f"{asked} CPU processes (gloo), as the notebook asks "
                                          "(--gpus / --nproc choose otherwise).")
    if asked <= visible:
        return Devices("cuda", asked, note=f"{_gpus(asked)}, as the notebook asks (--gpus / --nproc choose otherwise).")
    return Devices("cuda", visible, note=(
        f"the notebook asks for {asked} processes and {_gpus(visible)} {'is' if visible == 1 else 'are'} visible: "
        f"training on {_gpus(visible)}, one process each (--cpu runs {asked} CPU processes instead)."))


def _gpus(count: int) -> str:
    return f"{count} GPU{'s' * (count != 1)}"


def rank_gpu(local_rank: int, visible: int, per_node: int | None = None,
             how: str = "torchrun --nproc_per_node {n}") -> int:
    """The GPU a rank drives, as ``cuda:<index>``: its ``LOCAL_RANK``, one GPU per rank.

    Every launcher numbers a machine's ranks 0 to N-1 (torchrun, Catalyst's spawn, the Ray plan), and a
    batch run's ``CUDA_VISIBLE_DEVICES`` shows its slot's GPUs as 0 to K-1, so ranks never share a GPU.
    ``visible``: the GPUs torch sees in the rank; ``per_node``: the processes started on this machine
    (``LOCAL_WORLD_SIZE``); ``how``: the command that starts ``{n}`` processes, for the message.

    Raises:
        DeviceError: this rank has no GPU of its own: more processes were started than there are GPUs
            (an exported script run by hand with ``torchrun --nproc_per_node 2`` on one GPU). Said in
            one line, instead of CUDA's "invalid device ordinal" from deep in the first CUDA call.
    """
    if 0 <= local_rank < visible:
        return local_rank
    started = max(per_node or 0, local_rank + 1)
    narrowed = os.environ.get("CUDA_VISIBLE_DEVICES")
    sees = f"torch sees {_gpus(visible) if visible else 'no GPU'} here" + (
        f" (CUDA_VISIBLE_DEVICES={narrowed})" if narrowed is not None else "")
    cpu = f"nbddp run --cpu --nproc {started}"
    instead = (f"Start {visible}, one per GPU: {how.format(n=visible)}, or nbddp run --gpus {visible} "
               f"(or {started} CPU processes: {cpu})." if visible else f"Train on the CPU instead: {cpu}.")
    raise DeviceError(f"local rank {local_rank} has no GPU: {started} processes were started on this machine, one "
                      f"per GPU, and {sees}. {instead}")


def resolve(gpus: str | int | None = None, cpu: bool = False, nproc: int | None = None,
            visible: int | None = None, ours: Sequence[str] = ()) -> Devices:
    """Turn ``--gpus/--cpu/--nproc`` into :class:`Devices`, or raise before anything starts.

    Raises:
        UsageError: a value that can never work (fewer than one process, contradictory flags), exit 2.
        DeviceError: more GPUs than this machine shows, exit 3.
    """
    if nproc is not None and nproc < 1:
        raise UsageError(f"--nproc {nproc}: need at least 1 process.")
    if cpu:
        if gpus is not None:
            raise UsageError("--cpu and --gpus contradict each other: choose one.")
        return Devices("cpu", nproc or CPU_PROCESSES)
    visible = visible_gpu_count() if visible is None else visible
    if gpus is None:
        if visible == 0:
            n = nproc or CPU_PROCESSES
            return Devices("cpu", n, note=f"no GPU visible: running on the CPU with {n} processes (gloo).")
        if nproc is not None and nproc > visible:
            raise DeviceError(f"--nproc {nproc} asks for more GPUs than the {visible} visible.")
        return Devices("cuda", nproc or visible)
    if nproc is not None:
        raise UsageError("--nproc counts CPU processes; with GPUs use --gpus N (one process per GPU).")
    if str(gpus).lower() == FREE:
        return free_devices(None, gpu_usage(), ours=ours)
    wanted = requested_gpus(gpus)
    if wanted is None:
        if visible == 0:
            raise DeviceError("--gpus all: no GPU is visible here. Use --cpu --nproc N to run on the CPU.")
        return Devices("cuda", visible)
    if wanted > visible:
        hint = " (CUDA_VISIBLE_DEVICES narrows them)" if "CUDA_VISIBLE_DEVICES" in os.environ else ""
        instead = f"Use --gpus {visible} or --cpu." if visible else "Use --cpu to run on the CPU."
        raise DeviceError(f"--gpus {wanted} asks for more GPUs than the {visible} visible{hint}. {instead}")
    return Devices("cuda", wanted)


# ---------------------------------------------------------------- shared GPU servers: which GPUs are free


@dataclass(frozen=True)
class GpuUse:
    """One GPU as NVML sees it now: who computes on it and how much of its memory is used."""

    index: int
    """NVML's index (the driver's order, which ``nvidia-smi`` shows)."""
    uuid: str
    processes: int
    """Compute processes on it; -1 where NVML won't count them."""
    used: int
    total: int
    holders: tuple[tuple[int, int], ...] = ()
    """``(pid, bytes)`` of each process NVML lists on it (its memory ``-1`` where NVML won't say): who holds it, as
    ``nbddp doctor`` names them. A pid of another container's is a number this machine's ``/proc`` doesn't know."""

    @property
    def busy(self) -> bool:
        """Someone computes on it (or NVML won't say), or holds more than :data:`BUSY_MEMORY` of its memory."""
        return self.processes != 0 or (self.total > 0 and self.used > BUSY_MEMORY * self.total)

    def describe(self) -> str:
        processes = (f"{self.processes} process{'es' * (self.processes != 1)}" if self.processes >= 0
                     else "processes unknown")
        return f"GPU {self.index}: {processes}, {self.used / 2**30:.1f} of {self.total / 2**30:.1f} GiB used"


def gpu_usage() -> list[GpuUse]:
    """Every GPU of this machine as NVML sees it now (``[]`` without NVML): what ``--gpus free`` judges by.

    A GPU whose UUID or memory NVML won't give is left out; one whose processes it won't count (a MIG parent
    without the privilege to ask, a driver error) is counted busy (``processes`` -1). Older drivers lack the
    newest names of the calls: the older ones are used there (with no buffer, their layouts don't matter).
    """
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return []

    class _Memory(ctypes.Structure):  # nvmlMemory_t
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    if _nvml(nvml, ("nvmlInit_v2", "nvmlInit")) != _NVML_SUCCESS:
        return []
    found = []
    try:
        count = ctypes.c_uint(0)
        if _nvml(nvml, ("nvmlDeviceGetCount_v2", "nvmlDeviceGetCount"), ctypes.byref(count)) != _NVML_SUCCESS:
            return []
        for index in range(count.value):
            handle, memory = ctypes.c_void_p(), _Memory()
            uuid, processes = ctypes.create_string_buffer(96), ctypes.c_uint(0)
            if (_nvml(nvml, ("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"), index,
                      ctypes.byref(handle)) != _NVML_SUCCESS
                    or _nvml(nvml, ("nvmlDeviceGetUUID",), handle, uuid, 96) != _NVML_SUCCESS
                    or _nvml(nvml, ("nvmlDeviceGetMemoryInfo",), handle, ctypes.byref(memory)) != _NVML_SUCCESS):
                continue
            # no buffer: NVML answers "insufficient size" (or success, when none runs) with the count set
            answer = _nvml(nvml, _PROCESS_CALLS, handle, ctypes.byref(processes), None)
            running = processes.value if answer in (_NVML_SUCCESS, _NVML_INSUFFICIENT_SIZE) else -1
            found.append(GpuUse(index, uuid.value.decode(errors="replace"), running, memory.used, memory.total,
                                _holders(nvml, handle, running)))
    finally:
        _nvml(nvml, ("nvmlShutdown",))
    return found


_NVML_SUCCESS, _NVML_INSUFFICIENT_SIZE = 0, 7


def driver_version() -> str | None:
    """The NVIDIA driver's version, as NVML says it (``None`` without NVML: no driver here)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if _nvml(nvml, ("nvmlInit_v2", "nvmlInit")) != _NVML_SUCCESS:
        return None
    try:
        text = ctypes.create_string_buffer(96)
        if _nvml(nvml, ("nvmlSystemGetDriverVersion",), text, 96) != _NVML_SUCCESS:
            return None
        return text.value.decode(errors="replace")
    finally:
        _nvml(nvml, ("nvmlShutdown",))

#: The calls listing a GPU's compute processes, newest first. The ``_v3`` and ``_v2`` ones fill ``nvmlProcessInfo_v2_t``
#: (pid, used memory, GPU and compute instance), the oldest ``nvmlProcessInfo_v1_t`` (pid, used memory).
_PROCESS_CALLS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
                  "nvmlDeviceGetComputeRunningProcesses")
#: NVML's "not available" for a process's used memory (``NVML_VALUE_NOT_AVAILABLE``: without the privilege to see it).
_NOT_AVAILABLE = 2**64 - 1


def _holders(nvml: ctypes.CDLL, handle: ctypes.c_void_p, running: int) -> tuple[tuple[int, int], ...]:
    """``(pid, bytes)`` of the processes NVML lists on ``handle`` (``()`` when it lists none or won't say)."""
    if running <= 0:
        return ()
    newest = next((name for name in _PROCESS_CALLS if hasattr(nvml, name)), None)
    fields = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong)]
    if newest != _PROCESS_CALLS[-1]:
        fields += [("gpu_instance", ctypes.c_uint), ("compute_instance", ctypes.c_uint)]

    class _Process(ctypes.Structure):  # nvmlProcessInfo_v2_t, or _v1_t for the oldest call
        _fields_ = fields

    if newest is None:
        return ()
    room = running + 8  # (more may have started since they were counted)
    for _ in range(2):  # (once more with the count NVML answers, when even more started meanwhile)
        count, table = ctypes.c_uint(room), (_Process * room)()
        answer = _nvml(nvml, (newest,), handle, ctypes.byref(count), table)
        if answer == _NVML_SUCCESS:
            return tuple((int(p.pid), -1 if p.used == _NOT_AVAILABLE else int(p.used)) for p in table[:count.value])
        if answer != _NVML_INSUFFICIENT_SIZE:
            break
        room = count.value + 8
    return ()


def _nvml(nvml: ctypes.CDLL, names: tuple[str, ...], *args: object) -> int:
    """Call the first of ``names`` this driver's NVML has; its return code (``-1``: none of them)."""
    for name in names:
        try:
            function = getattr(nvml, name)
        except AttributeError:
            continue
        return int(function(*args))
    return -1


def visible_usage(usage: Sequence[GpuUse], visible: str | None = None) -> list[GpuUse]:
    """The GPUs of ``usage`` this process may use, in ``CUDA_VISIBLE_DEVICES``'s order (``visible``; by default
    this process's): entries are NVML indices or UUIDs (a prefix is enough, as for CUDA); CUDA stops at the
    first that names no GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return list(usage)
    chosen: list[GpuUse] = []
    for entry in (e.strip() for e in visible.split(",") if e.strip()):
        match = [u for u in usage if (entry.isdigit() and u.index == int(entry)) or
                 (not entry.isdigit() and u.uuid.startswith(entry))]
        if len(match) != 1 or match[0] in chosen:
            break
        chosen.append(match[0])
    return chosen


def free_devices(wanted: int | None, usage: Sequence[GpuUse], visible: str | None = None,
                 ours: Sequence[str] = ()) -> Devices:
    """``--gpus free`` (``wanted`` ``None``: every free GPU) or ``--gpus N --wait`` (the first ``wanted`` free ones),
    from ``usage`` (:func:`gpu_usage`: tests hand in a machine of their own). ``ours``: the UUIDs of GPUs the
    caller's own warm ranks hold, free to it whatever NVML shows on them.

    Raises:
        DeviceError: no GPU visible, or fewer than ``wanted``; fewer free than ``wanted`` (at least one for
            ``free``), naming who holds what and how to wait.
    """
    seen = _judged(usage, visible, ours)
    flag = f"--gpus {wanted}" if wanted is not None else f"--gpus {FREE}"
    need = wanted or 1
    if not seen:
        raise DeviceError(f"{flag}: no GPU is visible here. Use --cpu --nproc N to run on the CPU.")
    if need > len(seen):
        raise DeviceError(f"{flag} asks for more GPUs than the {len(seen)} visible. Use --gpus {len(seen)} or --cpu.")
    free = [u for u in seen if not u.busy]
    if len(free) < need:
        raise DeviceError(f"{flag}: {_free_of(seen)}. Wait for {_gpus(need)} to be free: "
                          f"{'--gpus 1' if wanted is None else flag} --wait; or use --cpu.")
    chosen = free[:wanted] if wanted is not None else free
    busy = _in_use(seen)
    note = (f"training on the free GPU{'s' * (len(chosen) > 1)} {', '.join(str(u.index) for u in chosen)}"
            + (f" (in use: {busy})" if busy else ""))
    return Devices("cuda", len(chosen), note=note, gpu_ids=tuple(u.uuid for u in chosen))


def _judged(usage: Sequence[GpuUse], visible: str | None, ours: Sequence[str]) -> list[GpuUse]:
    """The visible GPUs (:func:`visible_usage`), those the caller's own warm ranks hold counted free."""
    return [u if u.uuid not in ours else GpuUse(u.index, u.uuid, 0, 0, u.total) for u in visible_usage(usage, visible)]


def _in_use(seen: Sequence[GpuUse]) -> str:
    """``GPU 0: 2 processes, 30.0 of 80.0 GiB used; …`` for the busy ones."""
    return "; ".join(u.describe() for u in seen if u.busy)


def _free_of(seen: Sequence[GpuUse]) -> str:
    """``1 of the 4 visible GPUs is free (GPU 0: 2 processes, 30.0 of 80.0 GiB used; …)``."""
    free = sum(not u.busy for u in seen)
    return f"{free} of the {len(seen)} visible GPUs {'is' if free == 1 else 'are'} free ({_in_use(seen)})"


def wait_for_free(wanted: int | None, say: Callable[[str], None], usage: Callable[[], list[GpuUse]] = gpu_usage,
                  sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                  ours: Sequence[str] = ()) -> Devices:
    """``--wait``: :func:`free_devices` once enough GPUs are free, saying what it waits for at once and every
    :data:`WAIT_SAY_SECONDS` (a Ctrl-C or a Stop ends the wait as it ends a run: nothing has started).

    Raises:
        DeviceError: as :func:`free_devices` for what waiting can't change: no GPU visible, fewer than ``wanted``.
    """
    said: float | None = None
    while True:
        now = usage()
        seen = _judged(now, None, ours)
        if len(seen) < (wanted or 1) or sum(not u.busy for u in seen) >= (wanted or 1):
            return free_devices(wanted, now, ours=ours)
        moment = clock()
        if said is None or moment - said >= WAIT_SAY_SECONDS:
            said = moment
            say(f"waiting for {_gpus(wanted or 1)} to be free (--wait): {_free_of(seen)}")
        sleep(WAIT_POLL_SECONDS)
