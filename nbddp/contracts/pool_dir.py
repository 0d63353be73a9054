"""The warm-pool folder contract: every file and folder of a pool of warm ranks, named in one place.

The kernel side (:mod:`nbddp.launchers.warm.pool`) and the ranks (:mod:`nbddp.rank_side.warm.loop`)
both address a pool's files through :class:`PoolDir`, as run dirs are addressed through
:class:`nbddp.contracts.rundir.RunDir`. It sits on the rank side, the lowest of its readers (the kernel side,
above it, may import it; the ranks may not import the launchers). Nothing here imports torch.

::

    POOL/                           a private temp folder, nbddp-warm-<owner pid>-XXXX
      pool.json                     what the pool was started with (its key, idle limit, launcher pid/group)
      preloaded.json                a starter started ahead of its first run has imported what its ranks will
      claimed                       such a starter was claimed, by its first run (``run``) or by itself
                                    leaving idle (``idle``): whoever created the file first
      go.json                       a starter started ahead of its first run (preloaded) is given it: the
                                    starter's options, the ranks' environment and folder (read, then removed)
      ready/rank-R                  rank R joined the group and waits (its pid)
      jobs/N.json                   job N: the script, its folder, its NBDDP_* variables
      taken/N-R                     rank R took job N (a rank without it hasn't: it won't run the job once stopped)
      plans/N-R.json                where rank R would start job N's setup (the ranks take the earliest)
      stopped/N                     job N was stopped: a rank yet to take it ends it without running it
      heard/N-R.json                rank R heard job N's interrupt: where it was (its Python frames)
      ended/N-R.json                rank R ended job N: ok, failed or interrupted, and the local modules it imported
      released/N-R                  rank R freed the process group after job N went wrong (its peers are woken)
      stacks/rank-R.txt             rank R's threads' Python stacks, written when the kernel asks (SIGUSR1)
      kept/rank-R.json              what rank R keeps of the setup (its cells, names and sizes), after its last job
      forget                        how many times the owner asked the ranks to drop their kept setup
      forgot/K-R                    rank R dropped it, asked for the K-th time
      failures/rank-R.json          rank R keeps the failure of its last job for a post-mortem (%ddp_debug): when, what
      debug/N/                      job N is a rank's post-mortem: its debugger session
                                    (:mod:`nbddp.contracts.debug_channel`)
      stop                          its owner is stopping it for good: the folder can go
      store/                        where torchrun's agent and the ranks meet (FileStores)
      logs/launcher.log             the ranks' starter's output, and the ranks' before each job
      logs/launch.json              what the starter saw when it ended: each rank's exit code, the first failure
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from nbddp.contracts.rundir import RunDir

class JobEnd(str, Enum):
    """How a rank ended a job (``ended/N-R.json``'s ``status``): the rank's word, judged into a run's
    :class:`~nbddp.contracts.status.Status` by the kernel side with the rest of the evidence."""

    OK = "ok"
    FAILED = "failed"
    INTERRUPTED = "interrupted"

    def __str__(self) -> str:
        return self.value


#: The pool folders' prefix in the system temp folder (the owner's pid follows).
FOLDER_PREFIX = "nbddp-warm-"


@dataclass(frozen=True)
class PoolDir:
    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def __str__(self) -> str:
        return str(self.path)

    @property
    def description(self) -> Path:
        return self.path / "pool.json"

    @property
    def go(self) -> Path:
        """The first run's word to a starter that preloaded its ranks' imports (:mod:`nbddp.launchers.warm.agent`)."""
        return self.path / "go.json"

    def claim(self, who: str) -> bool:
        """Claim a starter started ahead for ``who`` (``run``, ``idle``): ``True`` for the first to ask only. (The
        file is created exclusively: a first run and the starter's idle limit can't both win.)"""
        try:
            descriptor = os.open(self.path / "claimed", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w") as claim:
            claim.write(who)
        return True

    @property
    def preloaded(self) -> Path:
        """Such a starter has imported its ranks' imports (``{"seconds": …}``: how long that took)."""
        return self.path / "preloaded.json"

    @property
    def ready_dir(self) -> Path:
        return self.path / "ready"

    def ready(self, rank: int) -> Path:
        return self.ready_dir / f"rank-{rank}"

    def rank_pids(self) -> dict[int, int]:
        """Each rank's pid, from its ready mark (ranks still starting have none)."""
        pids = {}
        for path in self.ready_dir.glob("rank-*"):
            try:
                pids[int(path.name.split("-", 1)[1])] = int(path.read_text())
            except (OSError, ValueError):
                continue
        return pids

    @property
    def jobs(self) -> Path:
        return self.path / "jobs"

    def job(self, number: int) -> Path:
        return self.jobs / f"{number}.json"

    def jobs_handed_out(self) -> int:
        """How many jobs every process that used the pool handed it (jobs are numbered 0, 1, … in turn)."""
        return len(list(self.jobs.glob("*.json")))

    @property
    def job_exits_dir(self) -> Path:
        return self.path / "ended"

    def job_exit(self, number: int, rank: int) -> Path:
        """How ``rank`` left job ``number`` (its status), written as it leaves."""
        return self.job_exits_dir / f"{number}-{rank}.json"

    def taken(self, number: int, rank: int) -> Path:
        return self.path / "taken" / f"{number}-{rank}"

    def stopped(self, number: int) -> Path:
        return self.path / "stopped" / str(number)

    def heard(self, number: int, rank: int) -> Path:
        return self.path / "heard" / f"{number}-{rank}.json"

    def released(self, number: int, rank: int) -> Path:
        return self.path / "released" / f"{number}-{rank}"

    def plan(self, number: int, rank: int) -> Path:
        return self.path / "plans" / f"{number}-{rank}.json"

    def kept(self, rank: int) -> Path:
        return self.path / "kept" / f"rank-{rank}.json"

    @property
    def forget_request(self) -> Path:
        return self.path / "forget"

    def forgot(self, count: int, rank: int) -> Path:
        return self.path / "forgot" / f"{count}-{rank}"

    def failure(self, rank: int) -> Path:
        """Rank R's kept failure (its last job's, until the next job): ``{"job", "time", "type", "message",
        "run_dir"}``."""
        return self.path / "failures" / f"rank-{rank}.json"

    def debug_sessions(self, number: int) -> Path:
        """Job ``number`` is a post-mortem: the folder of its debugger sessions (one channel each)."""
        return self.path / "debug" / str(number)

    def stack(self, rank: int) -> Path:
        return self.path / "stacks" / f"rank-{rank}.txt"

    def mark(self, path: Path) -> None:
        """Create the empty mark ``path`` (and its folder): the fact is that it exists."""
        path.parent.mkdir(exist_ok=True)
        path.touch()

    @property
    def stop_mark(self) -> Path:
        return self.path / "stop"

    @property
    def as_run_dir(self) -> RunDir:
        """The pool's starter writes where a run's starter does (its log, its launch report, the store the
        ranks meet in): those files are named as a run dir's."""
        return RunDir(self.path)

    @property
    def launcher_log(self) -> Path:
        return self.as_run_dir.launcher_log

    @property
    def launch_report(self) -> Path:
        return self.as_run_dir.launch_report

    @property
    def store(self) -> Path:
        return self.as_run_dir.store

    def owner(self) -> int | None:
        """The pid of the process that started the pool, from the folder's name."""
        pid = self.path.name[len(FOLDER_PREFIX):].split("-", 1)[0]
        return int(pid) if self.path.name.startswith(FOLDER_PREFIX) and pid.isdigit() else None
