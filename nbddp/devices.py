"""Which devices a run uses, decided before anything starts and without importing torch.

GPUs are counted through NVML (the driver's own library, loaded with ctypes)
narrowed by ``CUDA_VISIBLE_DEVICES``: importing torch only to count GPUs would
cost the launcher a second or more on every run.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from nbddp.errors import DeviceError, UsageError

#: CPU processes (gloo) per node when neither ``--nproc`` nor GPUs say otherwise.
CPU_PROCESSES = 2


@dataclass(frozen=True)
class Devices:
    """What the ranks run on: ``nproc`` processes, on ``cuda`` (one GPU each) or ``cpu`` (gloo)."""

    kind: str
    nproc: int
    note: str = ""
    """One line for the user when the choice was made for them (no GPU visible)."""

    def describe(self) -> str:
        return _gpus(self.nproc) if self.kind == "cuda" else f"{self.nproc} CPU processes (gloo)"


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
    """``--gpus`` as a count, ``None`` for ``all``.

    Raises:
        UsageError: neither a positive number nor ``all`` (exit 2).
    """
    if str(gpus).lower() == "all":
        return None
    try:
        wanted = int(gpus)
    except ValueError:
        raise UsageError(f"--gpus {gpus!r}: give a number or 'all'.") from None
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
            visible: int | None = None) -> Devices:
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
