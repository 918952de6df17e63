"""Addresses: this node's IP, a free TCP port (or one held until its server
takes it), this host's address toward a peer, where a service binds, which
addresses stay on this host, and the keys that guard the ones that do not.

One place for what every process needs to say where it listens, and the one
rule about who may reach it: a socket on a loopback address (or ``ipc://``,
``inproc://``) is reachable from this host only; any other address is
reachable from the network, and rlflow's transport opens a socket there only
with the run's CURVE keys (see `CurveKeys` and `rlflow.data.transport`).
"""

from __future__ import annotations

import ipaddress
import socket

import msgspec


def node_ip() -> str:
    """This node's address on its default route (loopback if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: it only picks a route
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def bind_host(host: str) -> str:
    """The address to bind on for the setting ``cluster.host``: `host`, or,
    if it is empty, this node's own IP (so that other nodes can reach it)."""
    return host or node_ip()


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP address or ``localhost``) is reachable from this
    host only. Names other than ``localhost``, wildcards (``0.0.0.0``, ``*``)
    and interface names are not: they may be reachable from the network."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_is_local(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable from this host only:
    ``ipc://`` and ``inproc://``, or ``tcp://HOST:PORT`` on a loopback
    address (a ``tcp://SOURCE;HOST:PORT`` connect is judged by HOST)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(";")[2].rpartition(":")[0]
    return is_loopback(host)


def free_port(host: str = "") -> int:
    """A TCP port that is free on `host` now (another process may take it before it is bound)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def listener(host: str = "") -> socket.socket:
    """A TCP socket that listens on `host` at a port the system picks. Unlike
    `free_port`'s, the port is this process's from now on: nothing else can
    bind it before the server it is meant for takes the socket over (a
    torch `TCPStore`'s ``master_listen_fd``); peers that connect early wait
    in its backlog."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


#: Listening sockets this process holds for a server it will start, by port.
_held: dict[int, socket.socket] = {}


def hold_port(host: str = "") -> int:
    """A port that this process listens on until `take_held` hands it over
    (how the launcher reserves a trainer's MASTER_PORT in the process that
    rank 0 then runs in)."""
    sock = listener(host)
    port = sock.getsockname()[1]
    _held[port] = sock
    return port


def take_held(port: int) -> socket.socket | None:
    """The socket `hold_port` holds for `port`, now the caller's (None if this
    process holds none: the server binds the port itself)."""
    return _held.pop(port, None)


def local_address(peer: str) -> str:
    """This host's address on the route to `peer` (loopback stays loopback)."""
    if peer.startswith("127.") or peer == "localhost":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 1))
        return probe.getsockname()[0]


class CurveKeys(msgspec.Struct, frozen=True, kw_only=True):
    """A run's CURVE keys, as Z85 text (40 characters each).

    All of a run's processes are one trust domain, so a run has two
    keypairs: every socket that binds (the controller's ROUTER, each input
    PULL, the trainer's weight server) is a CURVE server with the server
    keypair, and every socket that connects is a CURVE client with the
    client keypair. A server accepts only a client that proves it holds the
    client secret key (see `rlflow.data.transport`): a process without these
    keys can neither connect to a run's sockets nor read what crosses them.
    The launcher makes them (`transport.new_curve_keys`) and hands them to
    each service in its `ServiceSpec`; `rlflow down` reads them from the
    owner-only ``controller.json``. Their repr shows the public keys only.
    """

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    def __repr__(self) -> str:
        return f"CurveKeys(server_public={self.server_public!r}, client_public={self.client_public!r})"
