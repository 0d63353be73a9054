"""The front doors: thin shells that parse what the user gave and call :mod:`nbddp.job.orchestrator`.

``nbddp`` on the command line (:mod:`.cli`), a notebook file run top to bottom with its kernel
(:mod:`.notebook_run`, also ``nbddp.run()``), ``%%ddp_train`` (:mod:`.jupyter`), ``nbddp batch``
(:mod:`.batch`), ``papermill --engine nbddp`` (:mod:`.papermill`), ``nbddp export`` and
``jupyter nbconvert --to nbddp`` (:mod:`.export`, :mod:`.nbconvert`).
"""
