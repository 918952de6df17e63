"""trio-native ZeroMQ sockets that speak rlflow's protocol.

Two patterns:

* streams: `open_push` / `open_pull` (PUSH/PULL). High-water marks bound the
  messages queued at each end, so a slow consumer blocks its producer
  instead of growing memory, and nothing is dropped. Replicas of one role
  share a stream: PUSH load-balances, PULL fair-queues.
* control: `open_router` / `open_dealer` (ROUTER/DEALER) for the controller
  and its services, with `Dealer.request` for a reply within a deadline.

Every socket is an async context manager that closes it on exit. Sends and
receives are cancellation-safe: a cancelled `recv` has taken nothing off the
socket, a cancelled `send` has queued nothing. A receive that meets a bad
message counts it by kind, logs it, and goes on to the next one.

ZeroMQ signals readiness on one edge-triggered file descriptor per socket,
and trio allows one waiter per descriptor. So the first operation that has
to wait watches the descriptor and the others park behind it; every
completed operation wakes them all, because an operation can consume the
edge another task was waiting for (see `Socket._until`).

Who may reach a socket: one on a loopback address (or ``ipc://``) is
reachable from this host only and needs nothing more. Any other address is
reachable from the network, so a socket opened with `curve` (the run's
`CurveKeys`) speaks CURVE (encrypted, and a peer must prove it holds the
run's keys), and one without is refused (`InsecureEndpoint`) before it binds
or connects there. A CURVE server accepts only its run's client key: the
process's ZAP handler checks every client key (see `_ServerKeys`).

Large tensors between processes of one machine: a sending socket given
`ShmSettings` puts tensors of at least ``min_bytes`` bytes in shared memory
(`rlflow.data.shm`) while every peer it may send to is known to take them
(`open_push(shm_peers=...)`, `connect(..., shm=True)`) and reachable only
from this host; the socket then carries the header and a description of the
segment. A receiving socket takes such messages unless opened with
``shm=False``. Cancellation safety holds for them too: a cancelled send has
left its segment free.

This is the only module that imports zmq.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar, cast

import trio
import zmq
from zmq.auth.thread import ThreadAuthenticator

from rlflow.data.net import CurveKeys, endpoint_is_local
from rlflow.data.shm import SegmentMap, SegmentPool, ShmSettings
from rlflow.protocol import Codec, ControlMessage, DataMessage, Message, ProtocolError
from rlflow.protocol.codec import MAX_FRAMES

log = logging.getLogger("rlflow.data.transport")

#: Default high-water mark, in messages, at each end of a stream.
DEFAULT_HWM = 8

#: Environment for processes that receive large messages (set before they
#: start: glibc reads it once). ZeroMQ allocates a fresh buffer for every
#: frame it receives, and by default glibc maps large ones freshly from the
#: kernel and unmaps them when freed, so every 64 MiB weight update paid
#: 16k page faults and a zeroing pass (64 MiB of 4 MiB tensors: median
#: 37 ms -> 15 ms over tcp here). With these, buffers of up to 32 MiB come
#: from the heap and freed ones are kept for the next message, up to 1 GiB.
PROCESS_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


#: A ROUTER's send to a peer at its high-water mark is retried after this
#: pause, doubling up to the most.
ROUTER_RETRY_S = 0.001
ROUTER_RETRY_MAX_S = 0.05

#: Operations that found their socket ready may run this many times in a row
#: before one yields to other tasks (see `Socket._done`).
YIELD_EVERY = 16


class TransportError(Exception):
    """A socket operation failed for a reason other than a bad message."""


class PeerUnreachable(TransportError):
    """A ROUTER was asked to send to an identity that is not connected."""


class InsecureEndpoint(TransportError):
    """A socket without CURVE keys was asked to bind or connect to an address
    that other hosts can reach."""


_context: zmq.Context | None = None
_authenticator: ThreadAuthenticator | None = None


def context() -> zmq.Context:
    """The process's ZeroMQ context (one per process, created on first use).

    At exit it is terminated, which waits for each closed socket's linger:
    messages queued on a closed PUSH still reach their peer if it is there
    to take them within that time. A socket left open is closed at once.
    """
    global _context
    if _context is None:
        # pyzmq keeps zero-copy buffers alive until ZeroMQ has sent them, and
        # drops them in an atexit hook of its own module. Import it first so
        # that our hook (atexit runs last-registered first) lets queued
        # messages leave before their buffers go.
        import zmq.utils.garbage  # noqa: F401

        _context = zmq.Context()
        atexit.register(_terminate, _context)
    return _context


def _terminate(ctx: zmq.Context) -> None:
    global _authenticator
    # Its thread polls sockets of this context: stop it before they are closed.
    if _authenticator is not None:
        _authenticator.stop()
        _authenticator = None
    ctx.destroy(linger=0)


def new_curve_keys() -> CurveKeys:
    """A fresh pair of keypairs for one run (see `CurveKeys`)."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return CurveKeys(
        server_public=server_public.decode(),
        server_secret=server_secret.decode(),
        client_public=client_public.decode(),
        client_secret=client_secret.decode(),
    )


class _ServerKeys:
    """The ZAP handler's answer: a client completes the CURVE handshake with
    a server socket only if its public key is its run's client key.

    Without a ZAP handler, libzmq admits any client that knows the server's
    public key, whatever its own keypair: the server public key would be the
    run's only secret, though CURVE treats it as public (it may be logged or
    shown). With this, a client must hold the run's client secret key too.
    Each server socket is a ZAP domain of its own, so that each counts the
    clients it refused (its `Socket.rejected["unauthenticated"]`).

    `callback` runs on the handler's thread; it reads what the sockets'
    thread registers, and must not raise (that would end the handler).
    """

    def __init__(self) -> None:
        #: ZAP domain -> the client public key it admits.
        self.allowed: dict[str, str] = {}
        #: ZAP domain -> the socket's name, for the log.
        self.names: dict[str, str] = {}
        #: ZAP domain -> handshakes refused (written by the handler's thread only).
        self.refused: dict[str, int] = {}
        self._domains = itertools.count()

    def admit(self, keys: CurveKeys, name: str) -> str:
        """A new domain that admits the client key of `keys`."""
        domain = f"rlflow.{next(self._domains)}"
        self.allowed[domain], self.names[domain] = keys.client_public, name
        return domain

    def forget(self, domain: str) -> None:
        self.allowed.pop(domain, None)
        self.names.pop(domain, None)
        self.refused.pop(domain, None)

    def callback(self, domain: str, client_key: bytes) -> bool:
        if self.allowed.get(domain) == client_key.decode("ascii", "replace"):
            return True
        count = self.refused[domain] = self.refused.get(domain, 0) + 1
        if count <= 3 or count % 1000 == 0:
            log.warning("%s: refused CURVE client #%d: its key is not the run's", self.names.get(domain, domain), count)
        return False


_server_keys = _ServerKeys()


def _zap_domain(keys: CurveKeys, name: str) -> str:
    """Start the process's ZAP handler (once) and register a domain that
    admits the run's client key (see `_ServerKeys`); the domain.

    libzmq admits every client when no ZAP handler listens, so the handler
    must run before a CURVE server socket binds: `Socket._secure` calls this
    before `_open` binds.
    """
    global _authenticator
    if _authenticator is None:
        auth = ThreadAuthenticator(context(), log=log.getChild("zap"))
        auth.start()
        _authenticator = auth
    domain = _server_keys.admit(keys, name)
    _authenticator.configure_curve_callback(domain, _server_keys)
    return domain


def _check_local(name: str, verb: str, address: str) -> None:
    """Refuse to `verb` (bind, connect) a socket without CURVE off this host."""
    if not endpoint_is_local(address):
        raise InsecureEndpoint(
            f"{name}: refusing to {verb} {address} without CURVE keys: other hosts can reach it; use a loopback "
            "address (cluster.host = \"127.0.0.1\") or let the run use CURVE (cluster.curve: rlflow up makes the "
            "keys whenever cluster.host is not loopback)"
        )


class Socket:
    """A ZeroMQ socket driven from trio, encoding with one `Codec`."""

    def __init__(self, sock: zmq.Socket, codec: Codec, name: str, curve: CurveKeys | None = None):
        self._sock = sock
        self._codec = codec
        self.name = name
        #: The run's keys, if this socket speaks CURVE.
        self.curve = curve
        self._zap_domain = ""
        self._fd = sock.fileno()
        self._changed = trio.Event()
        self._parked = 0
        self._leader: trio.CancelScope | None = None
        self._rejected: Counter[str] = Counter()
        #: Messages of more frames than this are thrown away on receipt.
        self.max_frames = MAX_FRAMES
        self.sent = 0
        self.received = 0
        #: Bytes received (header and tensor frames).
        self.bytes_received = 0
        self.bytes_sent = 0
        self._closed = False
        self._unyielded = 0
        #: Sends tensors through shared memory (a sending socket given `ShmSettings`).
        self.pool: SegmentPool | None = None
        #: Takes tensors from shared memory (None: such messages are rejected, ``shm``).
        self.segments: SegmentMap | None = None
        #: Peer address -> whether it takes tensors in shared memory.
        self._peers: dict[str, bool] = {}
        self._shm_now = False
        #: Tensor bytes sent through shared memory (not in `bytes_sent`).
        self.bytes_shared = 0

    @property
    def rejected(self) -> Counter[str]:
        """Bad messages received, by `ProtocolError.kind`, and CURVE clients
        refused for a key that is not the run's (``unauthenticated``)."""
        out = Counter(self._rejected)
        if refused := _server_keys.refused.get(self._zap_domain, 0):
            out["unauthenticated"] += refused
        return out

    def _secure(self, *, server: bool) -> None:
        """Make the socket a CURVE server (for its binds) or client (for its
        connects), with the run's keys."""
        keys, sock = self.curve, self._sock
        assert keys is not None
        if server:
            self._zap_domain = _zap_domain(keys, self.name)
            sock.setsockopt_string(zmq.ZAP_DOMAIN, self._zap_domain)
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret.encode())
        else:
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public.encode())
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public.encode())
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret.encode())

    # -- readiness ----------------------------------------------------------

    def _wake(self) -> None:
        """Make every parked operation re-check the socket's state."""
        if self._leader is not None:
            self._leader.cancel()
        if self._parked:
            self._changed.set()
            self._changed = trio.Event()

    async def _done(self) -> None:
        """End an operation that has completed.

        An operation that did not have to wait yields to the scheduler only
        every `YIELD_EVERY` times: a full scheduling round costs more than a
        small message, and a stream that is always ready would otherwise pay
        it per message. Cancellation is still checked on entry to every
        operation; nothing can cancel an operation after it has taken or
        queued its message.
        """
        self._unyielded += 1
        if self._unyielded >= YIELD_EVERY:
            self._unyielded = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def _until(self, flag: int) -> None:
        """Wait until the socket's EVENTS has `flag`.

        The first operation to park waits on the descriptor (the leader);
        others park on an event that the leader sets when it wakes. Any
        completed operation wakes all of them, the leader by cancelling its
        wait, since that operation may have consumed the edge they await.
        """
        while not cast(int, self._sock.getsockopt(zmq.EVENTS)) & flag:  # EVENTS is an int option
            self._unyielded = 0
            if self._leader is None:
                with trio.CancelScope() as scope:
                    self._leader = scope
                    try:
                        await trio.lowlevel.wait_readable(self._fd)
                    finally:
                        self._leader = None
                        if self._parked:
                            self._changed.set()
                            self._changed = trio.Event()
            else:
                self._parked += 1
                try:
                    await self._changed.wait()
                finally:
                    self._parked -= 1

    # -- raw frames ---------------------------------------------------------

    async def send_frames(self, frames: Sequence[Any], *, identity: bytes | None = None) -> None:
        """Queue one multipart message; wait while the high-water mark is reached."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if identity is not None:
            frames = [identity, *frames]
        pause = ROUTER_RETRY_S
        while True:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                if identity is None:
                    await self._until(zmq.POLLOUT)
                else:
                    # A ROUTER is writable while any peer has room, so its
                    # POLLOUT cannot say when this peer has: retry after a
                    # pause that grows (the other peers' sends go on meanwhile).
                    await trio.sleep(pause)
                    pause = min(2 * pause, ROUTER_RETRY_MAX_S)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    raise PeerUnreachable(f"{self.name}: no peer with identity {identity!r}") from None
                raise TransportError(f"{self.name}: send failed: {exc}") from exc
        self.sent += 1
        self.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        self._wake()
        await self._done()

    async def recv_frames(self) -> list[zmq.Frame]:
        """Take one multipart message off the socket (frames are not copied)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while (frames := self._take_frames()) is None:
            await self._until(zmq.POLLIN)
        await self._done()
        return frames

    def _take_frames(self) -> list[zmq.Frame] | None:
        """One multipart message if one is here now, counted; else None.

        A message of more than `max_frames` frames is taken off the socket
        and thrown away frame by frame (counted as a `frame_count`
        rejection), so that a peer cannot make this process hold a million
        frame objects for a few bytes each on the wire.
        """
        try:
            frame = self._sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        frames = [frame]
        count, nbytes = 1, len(frame)
        # ZeroMQ delivers a multipart message whole: the rest is here now.
        while frame.more:
            frame = self._sock.recv(copy=False)
            count += 1
            nbytes += len(frame)
            if count <= self.max_frames:
                frames.append(frame)
            elif frames:
                frames = []
        self.received += 1
        self.bytes_received += nbytes
        self._wake()
        if count > self.max_frames:
            self._reject("frame_count", f"message of {count} frames; at most {self.max_frames} are accepted")
        return frames

    # -- shared memory ------------------------------------------------------

    @property
    def uses_shm(self) -> bool:
        """Whether the next large tensors sent go through shared memory: the
        socket has a pool, has peers, and every one of them takes them and
        is on this host (a PUSH may hand a message to any of its peers)."""
        return self._shm_now

    def _peer(self, address: str, shm: bool) -> None:
        self._peers[address] = shm and endpoint_is_local(address)
        self._shm_now = self.pool is not None and all(self._peers.values())

    def _forget(self, address: str) -> None:
        self._peers.pop(address, None)
        self._shm_now = self.pool is not None and bool(self._peers) and all(self._peers.values())

    # -- messages -----------------------------------------------------------

    async def _send_message(self, msg: Message, identity: bytes | None = None, shm: bool = True) -> None:
        pool = self.pool if shm and self._shm_now else None
        frames = self._codec.encode(msg, shm=pool)
        placed = pool.take_reserved() if pool is not None else None
        if placed is None:
            await self.send_frames(frames, identity=identity)
            return
        try:
            await self.send_frames(frames, identity=identity)
        except BaseException:
            placed.unsend()  # nothing was queued: the segment is free again
            raise
        self.bytes_shared += placed.nbytes

    def _decode(self, frames: Sequence[Any]) -> Message | None:
        if not frames:  # thrown away on receipt (see `_take_frames`)
            return None
        try:
            return self._codec.decode(frames, shm=self.segments)
        except ProtocolError as exc:
            self._reject(exc.kind, str(exc))
            return None

    def _reject(self, kind: str, why: str) -> None:
        """Count a bad message; log the first few of each kind and then every
        1000th, so that a hostile or broken peer cannot flood the log."""
        self._rejected[kind] += 1
        count = self._rejected[kind]
        if count <= 3 or count % 1000 == 0:
            log.warning("%s: rejected message #%d of kind %s: %s", self.name, count, kind, why)

    def close(self, linger_ms: int = 0) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(linger=linger_ms)
            if self.pool is not None:
                self.pool.close(linger_ms)
            if self.segments is not None:
                self.segments.close()
            if self._zap_domain:
                # Refused from now on. The handler keeps its entry for the
                # domain: removing it could race a handshake in flight.
                _server_keys.forget(self._zap_domain)

    @property
    def closed(self) -> bool:
        return self._closed


class Push(Socket):
    """The sending end of a stream."""

    async def send(self, msg: Message) -> None:
        await self._send_message(msg)


class Pull(Socket):
    """The receiving end of a stream."""

    async def recv(self) -> Any:
        """The next well-formed message; bad ones are counted and skipped."""
        while True:
            msg = self._decode(await self.recv_frames())
            if msg is not None:
                return msg

    def __aiter__(self) -> Pull:
        return self

    async def __anext__(self) -> Any:
        return await self.recv()

    def recv_nowait(self) -> Any | None:
        """The next well-formed message if one is already here, else None."""
        while (frames := self._take_frames()) is not None:
            msg = self._decode(frames)
            if msg is not None:
                return msg
        return None


class Router(Socket):
    """The controller's end of the control plane: one peer per identity."""

    #: Called with the sender's identity and the error for each message
    #: rejected (e.g. to answer a peer of another schema version).
    on_reject: Callable[[bytes, ProtocolError], None] | None = None

    async def send(self, identity: bytes, msg: Message, *, shm: bool = False) -> None:
        """Send `msg` to the peer `identity`; `shm`: that peer takes tensors in
        shared memory (it has said so, e.g. in its request), so a socket opened
        with `ShmSettings` on this host sends them that way."""
        await self._send_message(msg, identity, shm)

    async def recv(self) -> tuple[bytes, Any]:
        """The next well-formed message and the identity of its sender."""
        while True:
            frames = await self.recv_frames()
            if not frames:
                continue
            if len(frames) < 2:
                self._reject("frame_count", "no frame after the sender's identity")
                continue
            try:
                msg = self._codec.decode(frames[1:], shm=self.segments)
            except ProtocolError as exc:
                self._reject(exc.kind, str(exc))
                if self.on_reject is not None:
                    self.on_reject(frames[0].bytes, exc)
                continue
            return frames[0].bytes, msg


class Dealer(Socket):
    """A service's end of the control plane."""

    async def send(self, msg: Message) -> None:
        await self.send_frames(self._codec.encode(msg))

    async def recv(self) -> Any:
        while True:
            msg = self._decode(await self.recv_frames())
            if msg is not None:
                return msg

    async def request(self, msg: Message, reply: type | tuple[type, ...], *, timeout: float, setting: str) -> Any:
        """Send `msg` and return the first message of type `reply`.

        Raises `TimeoutError` after `timeout` seconds, naming `setting` as the
        knob to raise. Other messages that arrive meanwhile are dropped, so
        use this only where nothing else is expected (a handshake).
        """
        await self.send(msg)
        with trio.move_on_after(timeout):
            while True:
                answer = await self.recv()
                if isinstance(answer, reply):
                    return answer
                log.debug("%s: ignored %s while waiting for a reply", self.name, type(answer).__name__)
        raise TimeoutError(
            f"{self.name}: no {_names(reply)} within {timeout:g} s after {type(msg).__name__}; "
            f"is the peer running? raise {setting} if it is slow to start"
        )


def _names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


S = TypeVar("S", bound=Socket)


@asynccontextmanager
async def _open(
    cls: type[S],
    kind: int,
    codec: Codec,
    *,
    bind: str | None,
    connect: str | Sequence[str] | None,
    hwm: int,
    linger_ms: int,
    max_frame_bytes: int | None,
    identity: bytes | None = None,
    curve: CurveKeys | None,
    name: str,
    shm: ShmSettings | None = None,
    shm_peers: Collection[str] | None = None,
    take_shm: bool = True,
) -> AsyncIterator[S]:
    connects = [connect] if isinstance(connect, str) else list(connect or ())
    if curve is None:
        for verb, address in ([("bind", bind)] if bind is not None else []) + [("connect", a) for a in connects]:
            _check_local(name, verb, address)
    wrapper = cls(context().socket(kind), codec, name, curve)
    sock = wrapper._sock
    if shm is not None:
        wrapper.pool = SegmentPool(shm, name)
    if take_shm:
        wrapper.segments = SegmentMap()
    # Whoever connects to a bound socket is vouched for only without a list.
    if bind is not None:
        wrapper._peer(bind, shm_peers is None)
    for address in connects:
        wrapper._peer(address, shm_peers is None or address in shm_peers)
    try:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.LINGER, linger_ms)
        if max_frame_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if kind == zmq.PUSH:
            # Queue only to peers that are connected: a message for a peer
            # that died would wait in its pipe and vanish with it; this way a
            # send waits (or goes to a live peer) instead.
            sock.setsockopt(zmq.IMMEDIATE, 1)
        # CURVE options apply to the binds and connects made after they are
        # set: a socket that binds serves, one that connects is a client.
        if curve is not None:
            wrapper._secure(server=bind is not None)
        if bind is not None:
            sock.bind(bind)
        if curve is not None and bind is not None and connects:
            wrapper._secure(server=False)
        for address in connects:
            sock.connect(address)
    except BaseException:
        wrapper.close(0)
        raise
    try:
        yield wrapper
    finally:
        wrapper.close(linger_ms)


def bound_address(sock: Socket) -> str:
    """The address a socket is bound to (with the real port after ``:0``)."""
    return sock._sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: Socket, address: str, *, shm: bool = False) -> None:
    """Connect an open socket to one more peer (e.g. a replica that came up
    later); `shm`: the peer takes tensors in shared memory (see `open_push`)."""
    if sock.curve is None:
        _check_local(sock.name, "connect", address)
    sock._sock.connect(address)
    sock._peer(address, shm)
    sock._wake()  # a parked send or receive re-checks the socket


def disconnect(sock: Socket, address: str) -> None:
    """Stop sending to / receiving from a peer (e.g. a replica that died)."""
    sock._sock.disconnect(address)
    sock._forget(address)
    sock._wake()


def tcp_address(host: str = "127.0.0.1") -> str:
    """A TCP address on `host` with a port the OS picks at bind time."""
    return f"tcp://{host}:0" if ":" not in host else f"tcp://[{host}]:0"


def ipc_address(directory: str, name: str) -> str:
    """An ``ipc://`` address for a socket file `name` in `directory`."""
    path = os.path.join(directory, name)
    if len(path) > 100:  # sun_path holds 108 bytes with its terminator
        raise ValueError(f"ipc path {path!r} is {len(path)} bytes; at most 100 fit in a Unix socket address")
    return f"ipc://{path}"


def open_push(
    *,
    bind: str | None = None,
    connect: str | Sequence[str] | None = None,
    hwm: int = DEFAULT_HWM,
    linger_ms: int = 1000,
    codec: Codec | None = None,
    curve: CurveKeys | None = None,
    name: str = "push",
    shm: ShmSettings | None = None,
    shm_peers: Collection[str] | None = None,
) -> AbstractAsyncContextManager[Push]:
    """The sending end of a stream; `async with open_push(...) as push`.

    Every ``open_*`` takes `curve`, the run's keys: with them the socket
    speaks CURVE; without them it may bind or connect only on this host
    (`InsecureEndpoint` otherwise).

    With `shm`, large tensors go through shared memory while every peer
    takes them: the `connect` addresses listed in `shm_peers` (None: all of
    them, and whoever connects to `bind`), each on this host. The peers must
    have said so (rlflow's do through the controller: `Hello.shm`); a peer
    that does not take them would reject every such message. Closing waits
    up to `linger_ms` for segments in flight too (see `rlflow.data.shm`).
    """
    return _open(
        Push,
        zmq.PUSH,
        codec or Codec(DataMessage),
        bind=bind,
        connect=connect,
        hwm=hwm,
        linger_ms=linger_ms,
        max_frame_bytes=None,
        curve=curve,
        name=name,
        shm=shm,
        shm_peers=shm_peers,
        take_shm=False,
    )


def open_pull(
    *,
    bind: str | None = None,
    connect: str | Sequence[str] | None = None,
    hwm: int = DEFAULT_HWM,
    max_frame_bytes: int | None = None,
    codec: Codec | None = None,
    curve: CurveKeys | None = None,
    name: str = "pull",
    shm: bool = True,
) -> AbstractAsyncContextManager[Pull]:
    """The receiving end of a stream; `max_frame_bytes` caps any one frame a
    peer may send (ZeroMQ drops the connection of a peer that exceeds it).
    `shm`: take tensors in shared memory (else such messages are rejected)."""
    return _open(
        Pull,
        zmq.PULL,
        codec or Codec(DataMessage),
        bind=bind,
        connect=connect,
        hwm=hwm,
        linger_ms=0,
        max_frame_bytes=max_frame_bytes,
        curve=curve,
        name=name,
        take_shm=shm,
    )


def open_router(
    *,
    bind: str,
    hwm: int = 1000,
    max_frame_bytes: int | None = 64 << 20,
    codec: Codec | None = None,
    curve: CurveKeys | None = None,
    name: str = "router",
    shm: ShmSettings | None = None,
) -> AbstractAsyncContextManager[Router]:
    """The controller's control socket, or a server's (e.g. the trainer's
    weights). With `shm`, `Router.send(..., shm=True)` puts large tensors in
    shared memory (a ROUTER bound on this host; the peer vouches for itself)."""
    return _open(
        Router,
        zmq.ROUTER,
        codec or Codec(ControlMessage),
        bind=bind,
        connect=None,
        hwm=hwm,
        linger_ms=0,
        max_frame_bytes=max_frame_bytes,
        curve=curve,
        name=name,
        shm=shm,
    )


def open_dealer(
    *,
    connect: str,
    identity: bytes | None = None,
    hwm: int = 1000,
    linger_ms: int = 500,
    codec: Codec | None = None,
    curve: CurveKeys | None = None,
    name: str = "dealer",
) -> AbstractAsyncContextManager[Dealer]:
    """A service's control socket, connected to the controller."""
    return _open(
        Dealer,
        zmq.DEALER,
        codec or Codec(ControlMessage),
        bind=None,
        connect=connect,
        hwm=hwm,
        linger_ms=linger_ms,
        max_frame_bytes=None,
        identity=identity,
        curve=curve,
        name=name,
    )
