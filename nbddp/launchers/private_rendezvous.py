"""Where the ranks of a run on one machine meet: in files of the run's private folder, never on a socket.

torchrun's ``--standalone`` rendezvous is c10d's over a TCPStore that listens on every interface, and
torch's ``dynamic_rendezvous`` unpickles the state it reads from that store on every heartbeat: anyone
who reaches the port (another host, another user of this one) can read the run's keys and run code as
the notebook's user. A run on one machine needs no socket to meet, so (DESIGN.md, "Shared machines"):

* torchrun's agent meets in a FileStore (:func:`nbddp.engines.torch.torchrun_options` with ``store``) in
  the run's ``store/``
  folder, which is the user's alone (the run dir, or a warm pool's folder, is created 0700), and makes
  no TCPStore for its ranks to share (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). Its restarts
  (``--max-restarts``) work as before: the agent is still torchrun's, only its store is a file.
* the ranks join their process group through a FileStore there too (``NBDDP_STORE``, one file per
  restart attempt: :func:`nbddp.rank_side.torch_engine.join_group`; Catalyst's spawned ranks through
  ``file://``), so ``MASTER_ADDR``/``MASTER_PORT`` name nothing that listens;
* gloo's and NCCL's connections between the ranks bind the loopback interface (``GLOO_SOCKET_IFNAME``,
  ``NCCL_SOCKET_IFNAME``), not the address the host name resolves to, which may be a public one.

What is left on the network is gloo's (or NCCL's bootstrap) pair listeners, on the loopback address
only: another host can't reach them; another local user can connect to them but reads no key and
runs nothing (gloo exchanges tensors, never pickles). Several nodes must listen on the network; they
are the launchers' :func:`nbddp.launchers.topology_notes`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from nbddp.engines.torch import LOOPBACK
from nbddp.contracts.rank_env import RankEnv

#: Variables a user may have set on purpose (an interface of their choosing): kept as they are.
_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def prepare(folder: Path) -> Path:
    """Create the store folder (private: 0700, in a folder that is already the user's alone)."""
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def environment(folder: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the launcher of a run on one machine adds to its environment (the ranks inherit it)."""
    environ = os.environ if environ is None else environ
    interface = loopback_interface()
    added = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **RankEnv(store=folder).variables()}
    for name in _INTERFACE_VARIABLES:
        if not environ.get(name):
            added[name] = interface
    return added


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 (``lo`` on Linux)."""
    import socket

    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses):
            return name
    return "lo"
