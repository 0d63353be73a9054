"""``python -m nbddp``: the ``nbddp`` command."""

import sys

from nbddp.doors.cli import main

if __name__ == "__main__":  # (a documentation tool that imports every module runs nothing)
    sys.exit(main())
