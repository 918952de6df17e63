"""The zmq weight transfer (`WeightsZmq`, SPEC.md *Weights*): trainer rank 0
serves each version's tensors from a ROUTER, and every replica that loads
weights asks for the version it is told to load. Nothing but ZeroMQ is
needed on either side (no collective group to join, none to make again when
a replica is replaced), so it is the transfer of the simulated engines and of
a LoRA adapter for peers without torch.distributed."""

from __future__ import annotations

import trio
from rlflow.protocol import Codec, WeightsMessage, WeightsPayload, WeightsRequest
from rlflow.services.base import EngineContext, shm_settings, shm_token

from rlflow.data import transport

#: How long a replica waits for the version it asked for (the trainer answers once it has it).
FETCH_TIMEOUT_S = 120.0


class WeightServer:
    """Trainer rank 0's weight server: answers each `WeightsRequest` with the
    newest version published, once that is at least the one asked for."""

    def __init__(self, ctx: EngineContext):
        self.ctx = ctx
        self.latest: WeightsPayload | None = None
        self.address = ""
        self._published = trio.Event()

    def publish(self, payload: WeightsPayload) -> None:
        """`payload` is the newest version: requests for it (or an older one) are answered with it."""
        self.latest = payload
        self._published.set()

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Bind the ROUTER (its address in `address` once started) and answer requests until cancelled."""
        token = shm_token(self.ctx.config)
        async with transport.open_router(
            bind=transport.tcp_address(self.ctx.host),
            codec=Codec(WeightsMessage),
            curve=self.ctx.curve,
            name="weights",
            shm=shm_settings(self.ctx.config, self.ctx.run_id),
        ) as sock:
            self.address = transport.bound_address(sock)
            self.ctx.watch(sock)
            task_status.started()
            while True:
                identity, msg = await sock.recv()
                if not isinstance(msg, WeightsRequest):
                    continue
                while self.latest is None or self.latest.version < msg.version:
                    self._published = trio.Event()
                    await self._published.wait()
                try:
                    # In shared memory to a requester that can map this process's memory.
                    await sock.send(identity, self.latest, shm=bool(token) and msg.shm == token)
                except transport.PeerUnreachable:  # it died while it waited: its replacement asks again
                    self.ctx.counters["weights_unclaimed"] += 1
                self.ctx.counters["bytes_shared"] = sock.bytes_shared


async def fetch(ctx: EngineContext, weights: transport.Dealer, version: int) -> WeightsPayload:
    """Version `version` (or a newer one) from the weight server `weights` is connected to."""
    return await weights.request(
        WeightsRequest(version=version, shm=shm_token(ctx.config)),
        WeightsPayload,
        timeout=FETCH_TIMEOUT_S,
        setting="the trainer's weight server",
    )


def open_fetcher(ctx: EngineContext, address: str):
    """A DEALER connected to the weight server at `address` (an async context manager)."""
    return transport.open_dealer(connect=address, codec=Codec(WeightsMessage), curve=ctx.curve, name="weights")
