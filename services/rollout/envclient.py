"""A rollout replica's end of the env channel: requests to the env role's
replicas, and their replies.

One DEALER per env replica, each with a task that hands every reply to the
request that waits for it (by `request_id`); a request goes to the replica
with the fewest in flight. When the controller says a replica is gone (its
`Peers` no longer name it), or when one does not answer within
`roles.env.request_timeout_s`, the requests waiting on it raise `EnvLost`:
their episodes' groups are given back, to be granted again.

`InlineEnv` answers the same requests in this process instead
(`roles.env.inline`): the engine is held while each one runs.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from rlflow.data import transport
from rlflow.protocol import Codec, EnvMessage, EnvReply, EnvReset, EnvStep


class EnvLost(Exception):
    """The env replica a request went to is gone, or did not answer in time."""


class _Replica:
    def __init__(self, address: str) -> None:
        self.address = address
        self.dealer: transport.Dealer | None = None
        self.ready = trio.Event()
        self.scope = trio.CancelScope()
        self.waiting: dict[int, list[Any]] = {}  # request id -> [event, reply or error]


class EnvClient:
    """Requests to the env replicas at the addresses it follows (see the module)."""

    def __init__(self, *, curve: Any, name: str, timeout_s: float, watch: Callable[[Any], None] = lambda s: None,
                 counters: Counter[str] | None = None):
        self.curve, self.name, self.timeout_s, self.watch = curve, name, timeout_s, watch
        #: ``env_requests``: replies received (a rollout replica that waits on its env makes progress so).
        self.counters = counters if counters is not None else Counter()
        self.replicas: dict[str, _Replica] = {}
        self._ids = itertools.count()
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None

    async def run(self, addresses: list[str], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the sockets until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.follow(addresses)
            task_status.started()
            await trio.sleep_forever()

    def follow(self, addresses: list[str]) -> None:
        """Connect to new replicas; let go of those not named (their requests raise `EnvLost`)."""
        for address in list(self.replicas):
            if address not in addresses:
                self._drop(self.replicas.pop(address), f"env replica {address} is gone")
        for address in addresses:
            if address not in self.replicas:
                replica = self.replicas[address] = _Replica(address)
                self._nursery.start_soon(self._serve, replica)
        self._changed.set()
        self._changed = trio.Event()

    async def request(self, make: Callable[[int], EnvReset | EnvStep]) -> EnvReply:
        """The reply to `make(request_id)` from the least busy replica."""
        replica = await self._pick()
        request_id = next(self._ids)
        waiter = replica.waiting[request_id] = [trio.Event(), None]
        try:
            await replica.dealer.send(make(request_id))
            with trio.move_on_after(self.timeout_s):
                await waiter[0].wait()
            if not waiter[0].is_set():
                raise EnvLost(f"no answer from env replica {replica.address} within roles.env.request_timeout_s = "
                              f"{self.timeout_s:g} s")
        finally:
            replica.waiting.pop(request_id, None)
        if isinstance(waiter[1], EnvLost):
            raise waiter[1]
        return waiter[1]

    async def _pick(self) -> _Replica:
        while True:
            ready = [r for r in self.replicas.values() if r.ready.is_set()]
            if ready:
                return min(ready, key=lambda r: len(r.waiting))
            await self._changed.wait()  # none yet: wait for the controller to name one

    async def _serve(self, replica: _Replica) -> None:
        with replica.scope:
            async with transport.open_dealer(connect=replica.address, codec=Codec(EnvMessage), curve=self.curve,
                                             name=f"{self.name}/env") as dealer:
                self.watch(dealer)
                replica.dealer = dealer
                replica.ready.set()
                self._changed.set()
                self._changed = trio.Event()
                while True:
                    reply = await dealer.recv()
                    waiter = replica.waiting.get(reply.request_id) if isinstance(reply, EnvReply) else None
                    if waiter is not None:
                        self.counters["env_requests"] += 1
                        waiter[1] = reply
                        waiter[0].set()

    @staticmethod
    def _drop(replica: _Replica, why: str) -> None:
        replica.scope.cancel()
        for waiter in replica.waiting.values():
            waiter[1] = EnvLost(why)
            waiter[0].set()


class InlineEnv:
    """The env's answers worked out in this process (`roles.env.inline`), with
    the engine held while any of them runs (`hold`)."""

    def __init__(self, handler: Any, hold: Callable[[], Any]):
        self.handler = handler
        self.hold = hold
        self._ids = itertools.count()

    def follow(self, addresses: list[str]) -> None:
        """No replicas to follow."""

    async def request(self, make: Callable[[int], EnvReset | EnvStep]) -> EnvReply:
        msg = msgspec.msgpack.decode(msgspec.msgpack.encode(make(next(self._ids))), type=EnvMessage)
        async with self.hold():
            return await self.handler.answer(msg)
