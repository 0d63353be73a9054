"""The job side: one run from its run dir to its judged ending, whichever front door asked for it.

:mod:`.orchestrator` chains the stages; :mod:`.lifecycle` starts, follows and stops a job; :mod:`.follow`
and :mod:`.rank_output` turn the ranks' files into readable events; :mod:`.outcome` judges how it ended;
:mod:`.record` writes ``result.json``; :mod:`.registry` lists the runs alive now. The run dir's names
are a contract the ranks share (:mod:`nbddp.contracts.rundir`). Nothing here imports torch.
"""
