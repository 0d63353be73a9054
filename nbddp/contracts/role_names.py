"""The names of a cell's roles: its tags, its ``#| word`` directives, and the ``role`` of each segment
of a script's source map.

A leaf (it imports nothing), so that a warm rank reading a script's source map
(:mod:`nbddp.rank_side.warm.script_units`) can tell a parameters cell from a setup cell without importing
the notebook reader; what a role means is :mod:`nbddp.notebook.roles`'.
"""

PARAMETERS = "parameters"
INJECTED = "injected-parameters"
SETUP = "ddp"
TRAIN = "ddp-train"
ROLES = (PARAMETERS, INJECTED, SETUP, TRAIN)
#: Roles a user may write as a ``#| word`` directive (papermill writes the injected one).
DIRECTIVE_ROLES = (PARAMETERS, SETUP, TRAIN)
TRAIN_MAGIC = "ddp_train"
