"""``python -m nbddp.doors.jupyter.kernel_start -f CONNECTION_FILE``: the nbddp kernel, an IPython kernel that starts
the warm ranks' starter as the kernel itself starts (``nbddp kernel install`` installs it: :mod:`.kernelspec`).

In a plain kernel the starter starts at ``%load_ext nbddp``. Run back to back (Restart and Run All), the setup cell's
``import torch`` in the kernel and the starter's imports then begin together, and the first ``%%ddp_train`` waits for
what the starter has left to import (``torch._dynamo``, for DDP). This kernel starts it first thing, before it
imports ipykernel (0.7 s here), so that the starter is ahead of the notebook's cells by the kernel's own start.
Choosing the kernel is the intent to train; what the starter holds and when it leaves are as at ``%load_ext``
(:class:`nbddp.launchers.warm.preload.Preload`: torch's CPU side, no GPU, no socket, gone after the idle limit). Beside
a job (``nbddp run``, papermill's engine) it starts nothing, as ``%load_ext`` doesn't.

The extension itself is not loaded here: a notebook says ``%load_ext nbddp`` as in any kernel, and that adopts the
starter (and says so), so the notebook runs the same in a plain kernel.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from nbddp.doors.jupyter.kernel_pool import kernel_pool

        failed = kernel_pool.prepare(say=False)  # (its line is said by %load_ext nbddp; a failure to the kernel's log)
        if failed:
            print(f"[nbddp] {failed}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - the kernel starts all the same: %load_ext starts the starter then
        print(f"[nbddp] the nbddp kernel could not prepare the warm ranks ({type(exc).__name__}: {exc}); "
              "%load_ext nbddp starts them", file=sys.stderr)
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()


if __name__ == "__main__":
    main()
