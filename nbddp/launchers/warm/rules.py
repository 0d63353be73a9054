"""Which runs warm ranks may serve, and what makes a pool of them stale: the rules, apart from the pool.

:func:`why_not_warm` (can warm ranks serve this run at all), :class:`PoolKey` (what the ranks were started with:
when any of it changes, they start again) and :func:`ending_note` (how a run ended, when its ranks must be
judged before the next). Nothing here starts a process.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from nbddp.contracts.devices import Devices
from nbddp.contracts.rank_env import PER_RUN_VARIABLES
from nbddp.contracts.status import Status
from nbddp.engines import spawns_its_own_ranks

if TYPE_CHECKING:
    from nbddp.plan.options import LaunchOptions

def why_not_warm(engine: str, launch: "LaunchOptions") -> str:
    """Why warm ranks can't serve a run of ``engine`` with ``launch`` (``""``: they can). The one rule."""
    if spawns_its_own_ranks(engine):
        return f"warm ranks can't serve the {engine} engine (it spawns its own ranks)"
    if launch.nodes is not None or launch.slurm is not None or launch.ray is not None:
        return "warm ranks are for one machine"
    if launch.max_restarts:
        return "warm ranks can't be restarted by torchrun (--max-restarts)"
    return ""


@dataclass(frozen=True)
class PoolKey:
    """What warm ranks were started with: when any of it changes, they must start again."""

    device: str
    nproc: int
    python: str
    cwd: str
    environment: str
    """A digest of the environment the ranks inherited (per-run variables left out)."""
    collective_timeout: float | None

    def differs(self, other: "PoolKey") -> str:
        """What changed, in a few words (``""``: nothing)."""
        if (self.device, self.nproc) != (other.device, other.nproc):
            return f"the devices changed ({other.nproc} {other.device} → {self.nproc} {self.device})"
        if self.python != other.python:
            return "the Python interpreter changed"
        if self.cwd != other.cwd:
            return "the working folder changed"
        if self.environment != other.environment:
            return "environment variables changed"
        if self.collective_timeout != other.collective_timeout:
            return "--collective-timeout changed"
        return ""


def pool_key(devices: Devices, cwd: Path, launch: "LaunchOptions",
             environ: Mapping[str, str] | None = None) -> PoolKey:
    """What ranks for a run of ``launch`` on ``devices`` from ``cwd`` must have been started with (``environ``: what
    they inherit, this process's environment by default)."""
    environ = os.environ if environ is None else environ
    kept = sorted((k, v) for k, v in environ.items() if not k.startswith(PER_RUN_VARIABLES))
    digest = hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:16]
    return PoolKey(devices.kind, devices.nproc, sys.executable, str(Path(cwd).resolve()), digest,
                   launch.collective_timeout)


def ending_note(status: Status) -> str:
    """How the last run ended, when its ranks must be judged before the next (``""``: it succeeded)."""
    status = Status(status)
    return {Status.SUCCEEDED: "", Status.TIMEOUT: "the last run timed out",
            Status.INTERRUPTED: "the last run was interrupted"}.get(status, f"the last run {status}")
