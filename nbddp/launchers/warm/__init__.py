"""Warm ranks, the kernel's side: a pool of ranks kept between runs, and which runs they may serve.

A pool is nbddp's rank starter (:mod:`nbddp.launchers.warm.agent`) started once with
:mod:`nbddp.rank_side.warm.loop` as its module: N spawned rank
processes (never forked, so CUDA in the kernel is no hazard) that import torch, join the process
group and wait. Each run then hands its script to them (:meth:`WarmPool.submit`), which costs a
file write instead of a process start. A run on warm ranks means what a fresh run means: the script
runs with the run's own environment and run dir, and its training starts from the state a fresh
run's setup leaves; the ranks keep the setup cells that didn't change since they ran them
(:mod:`nbddp.rank_side.warm.state`), which :meth:`WarmPool.kept` reads and :meth:`WarmPool.forget` drops.

Three rules decide, and only they: :func:`~.rules.why_not_warm` (can warm ranks serve this run at all: the
engine, several nodes, Slurm, ``--max-restarts``), :func:`~.keepers.why_fresh` (can *this* pool serve it:
what the ranks were started with, whether they are alive and idle) and :meth:`PoolKeeper.after_run`
(after a run that didn't succeed, keyed by its :class:`~nbddp.contracts.status.Status`: the pool is kept
unless :meth:`WarmPool.why_not_kept` says why not). ``%%ddp_train`` keeps one pool per kernel
(:class:`KernelPool`); ``nbddp batch`` one per device slot (a :class:`PoolKeeper` each), which its
runs adopt (:meth:`WarmPool.adopt`, through :data:`POOL_ENV`).

The kernel's death takes the ranks with it (the starter runs under
:mod:`nbddp.rank_side.parent_death`, and removes the pool's folder: :mod:`nbddp.launchers.warm.agent`);
idle ranks exit after ``idle`` seconds. Nothing here imports torch.

The rooms: :mod:`.rules` (which runs warm ranks may serve, and what makes a pool stale), :mod:`.pool`
(the handle on one pool of ranks), :mod:`.run` (one job on it, followed like a launch), :mod:`.departure`
(how its ranks leave a stopped job), :mod:`.keepers` (keeping a pool between runs: a batch slot's, a kernel's),
:mod:`.agent` (the ranks' starter) and :mod:`.launcher` (the launcher seam's face). The rank side's half is
:mod:`nbddp.rank_side.warm`.
"""
