"""``python -m nbddp``: the ``nbddp`` command."""

import sys

from nbddp.doors.cli import main

sys.exit(main())
