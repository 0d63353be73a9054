"""nbddp/contracts/ports.py: a free port comes from below the kernel's ephemeral range (never handed to an outgoing
connection between the check and the bind), and from the OS where there is no room below it."""

import socket
import subprocess
import sys

from nbddp.contracts import ports


def test_a_free_port_is_below_the_ephemeral_range_and_free():
    low = ports._ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert max(1024, low - ports.SPAN) <= port < low
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))  # free indeed


def test_with_no_room_below_the_range_the_os_chooses(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 1500)  # fewer than 1000 ports below it
    port = ports.free_port()
    assert port >= 1500  # (not one of the few below)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))


def test_a_batch_scripts_shell_gets_one_for_every_interface():
    out = subprocess.run([sys.executable, "-m", "nbddp.contracts.ports", ""], capture_output=True, text=True, check=True)
    assert out.stdout.strip().isdigit() and int(out.stdout) < ports._ephemeral_low()
