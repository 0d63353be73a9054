"""A warm pool's starter started before the pool's first run, importing meanwhile what its ranks will import.

A kernel's first ``%%ddp_train`` would otherwise wait for its ranks' starter to import torch (1.2 s here) and for
DDP's first use to import ``torch._dynamo`` (1 s more): a first run of 3 s where a warm re-run takes 0.1 s. Loading
the extension is the intent to train: the kernel starts this starter then (:meth:`nbddp.launchers.warm.keepers.
KernelPool.prepare`), and the first run hands it its ranks (:class:`nbddp.launchers.warm.pool.WarmPool` with
``preload``), which it forks at once (:mod:`nbddp.launchers.warm.agent`, ``--preload``).

What it holds while it waits is torch's CPU side, shared with the ranks it forks: no rank, no process group, no
socket, no GPU (torch initialises CUDA in a rank, when a job asks). Unused for the idle limit, it leaves and its
folder goes, as idle warm ranks do. A first run it doesn't fit (another folder, another environment as torch's import
reads it, another ``OMP_NUM_THREADS``: :meth:`Preload.why_not`) gets a fresh starter and says why; the starter checks
the run's word again itself, and starts again as that run's plain starter where it doesn't fit. The first run and the
idle limit claim it exclusively (``PoolDir.claim``): a run never finds it gone.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Mapping

from nbddp.contracts.atomic import write_json
from nbddp.contracts.devices import resolve
from nbddp.contracts.owned import touch
from nbddp.contracts.pool_dir import FOLDER_PREFIX, PoolDir
from nbddp.contracts.rank_env import RankEnv
from nbddp.contracts.rank_memory import size
from nbddp.launchers import private_rendezvous
from nbddp.launchers.local_process import LaunchSpec, LocalProcess
from nbddp.contracts.process_groups import memory_held, owned_temp_dir
from nbddp.launchers.warm import agent
from nbddp.contracts.interpreter import module_argv


def ranks_environment(rank_env: RankEnv, store: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """What a warm pool's ranks (and their starter) inherit: ``environ``, nbddp's variables for them, and where they
    meet (:mod:`nbddp.launchers.private_rendezvous`)."""
    return rank_env.to_environ(environ) | private_rendezvous.environment(store, environ)


class Preload:
    """The starter of the kernel's next warm pool, started ahead of its first run (``%load_ext nbddp``)."""

    def __init__(self, idle: float, environ: Mapping[str, str] | None = None) -> None:
        """Start it from this process's folder, with ``environ`` (this process's by default), waiting ``idle``
        seconds for a run once it has imported what its ranks will.

        Raises:
            OSError: it could not be started (its folder is removed).
        """
        self.idle, self.cwd, self.python = idle, Path.cwd(), sys.executable
        self.dir = PoolDir(owned_temp_dir(FOLDER_PREFIX))
        self.started = time.monotonic()
        try:
            self.nproc = resolve().nproc  # a run with no options gets this many ranks: OMP_NUM_THREADS as theirs
            env = ranks_environment(RankEnv(warm=True),
                                    private_rendezvous.prepare(self.dir.store),
                                    os.environ if environ is None else environ)
            self.imported = agent.as_imported(env, self.nproc)
            """What of the ranks' environment its imports read (as :func:`~nbddp.launchers.warm.agent.as_imported`)."""
            argv = tuple(module_argv("nbddp.launchers.warm.agent", str(self.dir), agent.PRELOAD, f"{idle:g}",
                                     str(self.nproc), python=self.python))
            # Its own parent-death signal, armed first thing: the wrapper's interpreter would delay the first run.
            self.launch = LocalProcess(LaunchSpec(argv, env, self.cwd, self.dir.launcher_log, arms_itself=True))
        except BaseException:
            shutil.rmtree(self.dir.path, ignore_errors=True)
            raise
        try:
            write_json(self.dir.description, {"preload": True, "idle": idle, "pid": self.launch.pid,
                                              "pgid": self.launch.pgid})
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        """Running, and waiting for its first run (the starter removes the folder as it leaves, idle)."""
        return self.launch.poll() is None and self.dir.description.exists() and not self.dir.go.exists()

    def why_not(self, python: str, cwd: str, ranks_env: Mapping[str, str], nproc: int) -> str:
        """Why it can't start the ranks of a first run of ``python`` from ``cwd``, whose ranks inherit ``ranks_env``
        (``""``: it can, and is now claimed for that run). The starter checks again (:mod:`~nbddp.launchers.warm.
        agent`): what it imported with must be what the ranks get."""
        if not self.alive():
            return "it had left (idle) or was stopped"
        misfit = self.misfit(python, cwd, ranks_env, nproc)
        if misfit:
            return misfit
        try:
            claimed = self.dir.claim("run")
        except OSError:
            claimed = False
        return "" if claimed else "it was leaving (idle)"

    def misfit(self, python: str, cwd: str, ranks_env: Mapping[str, str], nproc: int) -> str:
        """What of ``python``, ``cwd`` and the ranks' environment differs from what it imported with (``""``:
        nothing), claiming nothing: :meth:`why_not`'s rule, which the nbddp kernel's ``%load_ext`` asks too."""
        if python != self.python:
            return "the Python interpreter changed"
        if str(Path(cwd).resolve()) != str(self.cwd.resolve()):
            return "the working folder changed"
        wanted = agent.as_imported(ranks_env, nproc)
        if wanted != self.imported:
            names = sorted(name for name in {*wanted, *self.imported} if wanted.get(name) != self.imported.get(name))
            if names == ["OMP_NUM_THREADS"]:
                return (f"{nproc} rank(s) get OMP_NUM_THREADS={wanted.get(names[0])}, and it imported torch for "
                        f"{self.imported.get(names[0])}")
            return f"environment variables changed ({', '.join(names[:3])}{', …' if len(names) > 3 else ''})"
        return ""

    def preloaded_in(self) -> float | None:
        """How long its imports took, once done (``None``: not yet)."""
        try:
            return float(json.loads(self.dir.preloaded.read_text())["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        """What ``%ddp_ranks`` says of it."""
        took = self.preloaded_in()
        state = (f"has imported torch and what DDP needs ({took:.1f}s)" if took is not None
                 else f"is importing torch ({time.monotonic() - self.started:.1f}s so far)")
        return (f"no warm ranks yet: their starter (pid {self.launch.pid}) {state}; the first %%ddp_train forks "
                f"them from it at once. It holds {size(memory_held(self.launch.pid))} of memory, no GPU, and leaves "
                f"after {self.idle:g}s without a run (%ddp_ranks stop releases it now)")

    def stop(self) -> None:
        """Stop it and remove its folder."""
        try:
            touch(self.dir.stop_mark)
        except OSError:
            pass
        if self.launch.poll() is None or self.launch.alive():
            self.launch.stop()
        shutil.rmtree(self.dir.path, ignore_errors=True)
