"""A free TCP port for a rendezvous store or a process group to listen on (a leaf: imports nothing of nbddp).

The usual trick, binding port 0 and reading what the OS gave, returns a port from the kernel's *ephemeral*
range, the one it also hands to every outgoing connection: between the check and the store's own bind,
moments later, any process connecting anywhere can be given that port, and the run fails with
``EADDRINUSE`` (seen on a busy machine: a Slurm job's torchrun, 1 run in about 50). A port chosen below that
range (as torch's own default, 29500, is) is never handed out implicitly, so only a process that binds that
very port can take it.
"""

from __future__ import annotations

import random
import socket
import sys

#: Where the kernel's ephemeral range starts when /proc doesn't say (Linux's default).
EPHEMERAL_LOW = 32768
#: How many ports below the ephemeral range are candidates (20768-32767 under Linux's default).
SPAN = 12000


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now (``""``: every interface), below the ephemeral range."""
    low = _ephemeral_low()
    floor = max(1024, low - SPAN)
    for _ in range(64 if low - floor >= 1000 else 0):
        port = random.randrange(floor, low)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:  # no room below the range on this machine: the OS's choice
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_LOW


if __name__ == "__main__":  # a batch script's shell: `port=$("$PYTHON" -m nbddp.contracts.ports "")`
    print(free_port(sys.argv[1] if len(sys.argv) > 1 else ""))
