"""The job side: one run from its run dir to its judged ending, whichever front door asked for it.

:mod:`.orchestrator` chains the stages; :mod:`.rundir` names every file of a run;
:mod:`.lifecycle` starts, follows and stops a job; :mod:`.follow` and :mod:`.rank_output` turn the
ranks' files into readable events; :mod:`.outcome` judges how it ended; :mod:`.record` writes
``result.json``; :mod:`.registry` lists the runs alive now. Nothing here imports torch.
"""
