"""The import path of every exported torch-engine script (``import nbddp.runtime as _nbddp``).

An exported script names this module, never the package's internal one, so it keeps working across
nbddp's internal moves (scripts exported by earlier versions name it too): it *is*
:mod:`nbddp.rank_side.torch_engine`, under its stable name.
"""

import sys

from nbddp.rank_side.parent_death import die_with_parent

die_with_parent()  # a rank nbddp launched dies with its launcher, armed before torch is imported (seconds)

from nbddp.rank_side import torch_engine  # noqa: E402 - after the death signal is armed

sys.modules[__name__] = torch_engine
