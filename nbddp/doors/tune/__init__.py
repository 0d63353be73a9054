"""Hyperparameter search on warm ranks: an Optuna study whose trials are runs of one training cell.

``space.py`` reads ``--space NAME=DIST(...)`` into a search space (and finds the names a space function gives);
``objective.py`` is the Optuna objective every door shares (a trial's values as ``-p`` overrides, the metric reported
to the trial as rank 0 logs it, a pruned trial's job stopped on the warm ranks) and the trials of a notebook file;
``study.py`` is ``nbddp tune`` and ``nbddp.tune()``: a study of its own, resumed from a storage; ``parallel.py`` runs
its trials at once, a worker process per device slot. The kernel's
``nbddp.objective`` (the last ``%%ddp_train`` cell as the trial) is :mod:`nbddp.doors.jupyter.tune`. Optuna is an
extra (``pip install 'nbddp[tune]'``), imported only here and only when a study runs.
"""
