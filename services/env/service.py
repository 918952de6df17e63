"""The env service: answers a rollout's requests for the steps of its episodes.

It starts the env pool (`rlflow.env.pool`: the environment and the tools in
worker processes, killed when a call overruns), binds a ROUTER (its ``env``
endpoint) and answers every `EnvReset` and `EnvStep` as it arrives, each in
a task of its own (the pool bounds how many run at once). What a request
asks and what the reply says is `rlflow.env.handler`'s; every call is
counted by outcome in the heartbeats. A replica holds no episode between
two requests (an episode's state travels with it), so any replica can take
any step, and one that dies loses only the requests it was answering: the
rollout gives their groups back, to be granted again.
"""

from __future__ import annotations

import trio

from rlflow.data import transport
from rlflow.env.handler import EnvHandler
from rlflow.protocol import Codec, EnvMessage, EnvReset, EnvStep, Shutdown
from rlflow.services.base import Control, Service, bind_host


class EnvService(Service):
    """Runs the environment and its tools for the rollout."""

    def __init__(self, spec):
        super().__init__(spec)
        self._working = 0

    def queues(self) -> dict[str, int]:
        return {"requests": self._working}

    async def main(self, control: Control) -> None:
        from rlflow.env import open_env_pool

        env = self.config.roles.env
        async with (
            open_env_pool(env.environment, env.tools, workers=env.workers, concurrency=env.concurrency,
                          start_timeout_s=env.start_timeout_s, import_dir=self.config.run.import_dir) as pool,
            transport.open_router(bind=transport.tcp_address(bind_host(self.config)), codec=Codec(EnvMessage),
                                  curve=self.spec.curve, name=f"{self.spec.name}/env") as router,
        ):
            self.sockets.append(router)
            handler = EnvHandler(pool, tools=env.tools, timeout_s=env.timeout_s, counters=self.counters)
            welcome = await control.hello(endpoints={"env": transport.bound_address(router)})
            self.say("up: %d workers, tools %s", env.workers, ", ".join(t.name for t in env.tools) or "none")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(control.heartbeats, self.heartbeat, welcome.heartbeat_s)
                nursery.start_soon(self.serve, router, handler, nursery)
                await control.ready(0)
                async for msg in control:
                    if isinstance(msg, Shutdown):
                        self.say("shutting down (%s)", msg.reason)
                        break
                nursery.cancel_scope.cancel()

    async def serve(self, router: transport.Router, handler: EnvHandler, nursery: trio.Nursery) -> None:
        """Answer each request in a task of its own."""
        self.clock.set("starved")
        while True:
            identity, msg = await router.recv()
            if not isinstance(msg, (EnvReset, EnvStep)):
                self.counters["unexpected_messages"] += 1
                continue
            self._working += 1
            self.clock.set("busy")
            nursery.start_soon(self.answer, router, handler, identity, msg)

    async def answer(self, router: transport.Router, handler: EnvHandler, identity: bytes,
                     msg: EnvReset | EnvStep) -> None:
        try:
            reply = await handler.answer(msg)
        finally:
            self._working -= 1
            if not self._working:
                self.clock.set("starved")
        try:
            await router.send(identity, reply)
        except transport.PeerUnreachable:
            self.log.info("[%s] the rollout replica that asked for request %d is gone", self.spec.name,
                          msg.request_id)
