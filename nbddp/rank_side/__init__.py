"""The rank side: what runs inside each training process (torch is imported there, never by ``import nbddp``).

:mod:`nbddp.contracts.rank_env` reads what the launcher set; :mod:`.process` is every rank's plumbing (logs, error
reports, leaving the group cleanly); :mod:`.ranks` says who this rank is; :mod:`.torch_engine` and
:mod:`.catalyst_engine` are the engines' glue and the API training cells use (``nbddp.prepare``,
``nbddp.log``, …); :mod:`.warm.loop` runs job after job in one warm process (the pool's files:
:mod:`nbddp.contracts.pool_dir`); :mod:`.parent_death` ties a process to its parent. A rank imports only
this package and :mod:`nbddp.contracts`: nothing of the plan, the launchers or the job, which import this
side, never the reverse.
"""
