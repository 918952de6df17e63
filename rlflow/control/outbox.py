"""What the controller says to peers: to each replica, through an outbox of
its own; to peers turned away, through the door.

The controller decides synchronously and posts what it has to say; each
replica's outbox sends it. So a replica that stops reading its control
socket (its pipe at the high-water mark) delays only its own messages,
never another replica's welcome or a weight order, and never the
controller's handling of what arrives.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import trio

from rlflow.data import transport
from rlflow.control.replicas import State
from rlflow.protocol import Bye, ErrorReport, Heartbeat, Shutdown

log = logging.getLogger("rlflow.controller")

#: Messages an outbox holds; one that fills up belongs to a replica that stopped reading.
OUTBOX_SIZE = 256


class Outbox:
    """Posts to one identity of a ROUTER (see the module)."""

    def __init__(self, router: transport.Router, identity: bytes, *, size: int = OUTBOX_SIZE):
        self.router = router
        self.identity = identity
        self.size = size
        self._in, self._out = trio.open_memory_channel(size)
        self._scope = trio.CancelScope()

    def post(self, msg: Any) -> bool:
        """Queue `msg`; False if the outbox is full (the peer has not taken
        its messages for a long while) or closed."""
        try:
            self._in.send_nowait(msg)
        except (trio.WouldBlock, trio.ClosedResourceError):
            return False
        return True

    def close(self) -> None:
        """Send nothing more (what is queued is dropped, a send under way abandoned)."""
        self._in.close()
        self._scope.cancel()

    async def run(self, unreachable: Callable[[], None]) -> None:
        """Send what is posted, in order, until closed; `unreachable()` when
        the ROUTER has no peer of this identity any more (it died)."""
        with self._scope:
            async for msg in self._out:
                try:
                    await self.router.send(self.identity, msg)
                except transport.PeerUnreachable:
                    unreachable()
                    return


#: Messages taken off the controller's socket and not yet handled, at most (the socket holds the rest).
INBOX = 4096


async def take(router: transport.Router, send: trio.MemorySendChannel) -> None:
    """Take the controller's messages off its socket as they come, each with the time it was taken."""
    async with send:
        while True:
            identity, msg = await router.recv()
            await send.send((identity, msg, time.perf_counter()))


#: Peers refused with an answer, at most (more are refused in silence).
MAX_REFUSED = 4096


class Door:
    """Who is turned away: counts every message not acted on by kind, and
    answers a peer that may not join (or was replaced) with a fatal
    `ErrorReport`: a refused hello once per identity (a flood is not answered
    in kind), a replaced incarnation at every message it sends, as far as a
    small queue allows. Sent by `run`, a peer that does not read is not
    waited for."""

    def __init__(self) -> None:
        self.ignored: collections.Counter[str] = collections.Counter()
        self._refused: set[bytes] = set()
        self._in, self._out = trio.open_memory_channel(16)

    def ignore(self, kind: str, what: str) -> None:
        """Count a well-formed message that is not acted on (log the first few)."""
        self.ignored[kind] += 1
        if self.ignored[kind] <= 3:
            log.warning("[controller] ignored %s", what)

    def refuse(self, identity: bytes, refusal: Any, *, every: bool = False) -> None:
        """Turn `identity` away with `refusal` (a `replicas.Refusal`)."""
        self.ignore(refusal.kind, refusal.message)
        if not every:
            if identity in self._refused or len(self._refused) >= MAX_REFUSED:
                return
            self._refused.add(identity)
        try:
            self._in.send_nowait((identity, ErrorReport(fatal=True, kind=refusal.kind, message=refusal.message)))
        except trio.WouldBlock:
            pass

    async def run(self, router: transport.Router) -> None:
        async for identity, report in self._out:
            with trio.move_on_after(1):
                try:
                    await router.send(identity, report)
                except transport.PeerUnreachable:
                    pass


class Outboxes:
    """An outbox for each registered replica (see `Outbox`). A replica found
    unreachable or stuck is queued as lost, never handled in the call that
    found it (often a handler midway, or the loss of another replica): the
    controller takes the queue with `losses` between two handlers."""

    def __init__(self) -> None:
        self._boxes: dict[bytes, Outbox] = {}
        self.router: transport.Router | None = None
        self.nursery: trio.Nursery | None = None
        self._lost: list[tuple[Any, int, str, bool]] = []
        self._found = trio.Event()

    def _queue_loss(self, replica: Any, why: str, kill: bool) -> None:
        if all(queued is not replica for queued, _, _, _ in self._lost):
            self._lost.append((replica, replica.incarnation, why, kill))
            self._found.set()

    async def losses(self) -> list[tuple[Any, str, bool]]:
        """The replicas found lost since the last call and still the incarnation found so, each (replica,
        why, whether to kill it); waits for one."""
        await self._found.wait()
        lost, self._lost, self._found = self._lost, [], trio.Event()
        return [(replica, why, kill) for replica, incarnation, why, kill in lost
                if replica.incarnation == incarnation and replica.registered]

    async def take_losses(self, lose: Callable[..., None]) -> None:
        """Forever: `lose(replica, why, kill=...)` for each replica found unreachable or stuck, one after
        another once the handler that found them is done (one found meanwhile is taken the next round)."""
        while True:
            for replica, why, kill in await self.losses():
                lose(replica, why, kill=kill)

    def open(self, replica: Any) -> None:
        """An outbox for `replica`'s registered incarnation."""
        assert self.router is not None and self.nursery is not None  # set by the controller before any hello
        outbox = self._boxes[replica.identity] = Outbox(self.router, replica.identity)
        incarnation = replica.incarnation

        def unreachable() -> None:
            if replica.incarnation == incarnation and replica.registered:
                log.info("[controller] %s is unreachable", replica.name)
                self._queue_loss(replica, "closed its connection", False)

        self.nursery.start_soon(outbox.run, unreachable)

    def close(self, replica: Any) -> None:
        if (outbox := self._boxes.pop(replica.identity, None)) is not None:
            outbox.close()

    def post(self, replica: Any, msg: Any) -> None:
        """Say `msg` to `replica`; one whose outbox is full has not read its
        control socket for a long while: lost."""
        outbox = self._boxes.get(replica.identity)
        if outbox is not None and not outbox.post(msg) and replica.registered:
            self._queue_loss(replica, f"took none of its last {outbox.size} control messages: presumed stuck", True)

    def post_each(self, pairs: list[tuple[Any, Any]]) -> None:
        """`post` each (replica, message) of `pairs`."""
        for replica, msg in pairs:
            self.post(replica, msg)

    def order(self, orders: list[Any], roster: Any) -> None:
        """Send weight orders (`rounds.Order`): to every trainer rank, or to a live rollout replica."""
        for order in orders:
            if order.rank is None:
                for replica in roster.role(order.role):
                    self.post(replica, order.message)
            elif (replica := roster.replicas.get((order.role, order.rank))) is not None and replica.live:
                self.post(replica, order.message)


async def farewell(router: transport.Router, roster: Any, reason: str, wait_s: float = 10.0,
                   heard: Callable[[Any, Heartbeat], None] | None = None) -> None:
    """Tell every registered replica of `roster` to stop (directly, not through
    the outboxes: this is the end), and wait up to `wait_s` for their goodbyes.
    A replica's last heartbeat, with its final counts and the version it ended
    at, comes just before its `Bye`: the version goes on the replica (a role
    that takes the steps it owes at shutdown ends ahead of its last beat in
    the run), and `heard(replica, beat)` takes the rest."""
    targets = [r for r in roster if r.registered]
    with trio.move_on_after(wait_s):
        for replica in targets:
            with trio.move_on_after(1):
                try:
                    await router.send(replica.identity, Shutdown(reason=reason))
                except transport.PeerUnreachable:
                    replica.state = State.GONE
        while any(r.registered for r in targets):
            identity, msg = await router.recv()
            replica = roster.by_identity.get(identity)
            if replica is not None and isinstance(msg, Bye | ErrorReport):
                replica.state = State.GONE
            elif replica is not None and isinstance(msg, Heartbeat):
                replica.version = max(replica.version, msg.version)
                if heard is not None:
                    heard(replica, msg)
