"""Addresses: this node's IP, a free TCP port, this host's address toward a peer.

One place for what every process needs to say where it listens.
"""

from __future__ import annotations

import socket


def node_ip() -> str:
    """This node's address on its default route (loopback if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: it only picks a route
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def free_port(host: str = "") -> int:
    """A TCP port that is free on `host` now (another process may take it before it is bound)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def local_address(peer: str) -> str:
    """This host's address on the route to `peer` (loopback stays loopback)."""
    if peer.startswith("127.") or peer == "localhost":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 1))
        return probe.getsockname()[0]
