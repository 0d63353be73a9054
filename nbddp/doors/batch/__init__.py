"""``nbddp batch``: one notebook, a grid of parameter sets, each run a full ``nbddp run``."""
