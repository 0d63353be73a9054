"""The exceptions nbddp raises, where its users catch them (``nbddp.errors.RunFailed``, as the README writes).

They live in :mod:`nbddp.contracts.errors`, at the bottom of the package, with everything else every layer
reads; this module only hands them on, so that a user's import stays the same.
"""

from nbddp.contracts.errors import (  # noqa: F401 - handed on
    CellError, CellSyntaxError, CheckpointError, DeviceError, NbddpError, NotebookError, ParameterError, RunError,
    RunFailed, RunInterrupted, RunTimeout, SignalReceived, UsageError,
)
