"""The rank side: what runs inside each training process (torch is imported there, never by ``import nbddp``).

:mod:`.env` reads what the launcher set; :mod:`.process` is every rank's plumbing (logs, error
reports, leaving the group cleanly); :mod:`.ranks` says who this rank is; :mod:`.torch_engine` and
:mod:`.catalyst_engine` are the engines' glue and the API training cells use (``nbddp.prepare``,
``nbddp.log``, …); :mod:`.warm_loop` runs job after job in one warm process (:mod:`.pool_dir`: the
pool's files); :mod:`.parent_death` ties a process to its parent. A rank imports nothing of the
launchers, the job or the launch options: the launcher side imports this side, never the reverse.
"""
