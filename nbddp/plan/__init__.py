"""The plan: how a job is asked for, above the notebook side and the engines it reads.

:mod:`.options` declares every launch option once (its fields: :mod:`.option_fields`), for every front door;
:mod:`.job_spec` is the frozen value a launcher reads (the script, the devices, the run dir, the options).
Nothing here starts a process or imports torch.
"""
