"""The import path of every exported Catalyst-engine script (``import nbddp.runtime_catalyst as _nbddp``).

Scripts exported by earlier nbddp versions name this module, so it stays: it *is*
:mod:`nbddp.rank_side.catalyst_engine`, under its old name.
"""

import sys

from nbddp.rank_side import catalyst_engine

sys.modules[__name__] = catalyst_engine
