"""The import path of every exported torch-engine script (``import nbddp.runtime as _nbddp``).

Scripts exported by earlier nbddp versions name this module, so it stays: it *is*
:mod:`nbddp.rank_side.torch_engine`, under its old name.
"""

import sys

from nbddp.rank_side import torch_engine

sys.modules[__name__] = torch_engine
