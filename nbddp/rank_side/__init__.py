"""The rank side: what runs inside each training process (imports torch; never imported by ``import nbddp``).

:mod:`.env` reads what the launcher set; :mod:`.process` is every rank's plumbing (logs, error
reports, leaving the group cleanly); :mod:`.torch_engine` and :mod:`.catalyst_engine` are the
engines' glue and the API training cells use (``nbddp.prepare``, ``nbddp.log``, …);
:mod:`.warm_loop` runs job after job in one warm process.
"""
