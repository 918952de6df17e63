"""The rollout service: turns credits into prompt groups, generates, streams
finished groups to the next role.

Its loop: credits arrive on the control channel -> the task makes each
group's prompt -> the engine generates `n` responses per prompt with
continuous batching -> each group is sent on the moment its last response
finishes, as one columnar `SampleBatch` with every other group finished by
then (one message and one acknowledgement however many: when this process
is behind, it catches up in fewer, larger messages). Weight updates arrive while
requests are in flight; the engine applies them between two decode steps and
tags later tokens with the new version.
"""

from __future__ import annotations

import time

import trio

from rlflow.data import transport
from rlflow.data.tasks import Task
from rlflow.protocol import Ack, Credits, EvalDone, Evaluate, Shutdown, Stage, UpdateWeights, WeightsLoaded, build_batch
from rlflow.services.base import Control, Service
from rlflow.services.rollout.engine import RolloutEngine, make_engine


class RolloutService(Service):
    """Generates responses for the prompt groups the controller grants."""

    def __init__(self, spec):
        super().__init__(spec)
        self.engine: RolloutEngine | None = None
        self._wanted: UpdateWeights | None = None
        self._update = trio.Event()

    async def main(self, control: Control) -> None:
        run = self.config.run
        engine = self.engine = make_engine(self.context())
        try:
            self.say("starting %s", type(engine).__name__)
            started = time.monotonic()
            await engine.start()
            self.say("%s started in %.1f s", type(engine).__name__, time.monotonic() - started)
            task = self.load_task()
            welcome = await control.hello(endpoints={}, info=engine.hello_info())
            await engine.set_version(welcome.version)  # above 0 when resuming
            self.version = welcome.version
            await engine.join_weights(welcome.weights, welcome.layout)
            self.say("up: %s, sending to %s", type(engine).__name__, ", ".join(welcome.peers["out"]))
            async with (
                transport.open_push(connect=welcome.peers["out"], name=f"{self.spec.name}/out") as out,
                trio.open_nursery() as nursery,
            ):
                await nursery.start(engine.run)
                nursery.start_soon(control.heartbeats, self.heartbeat, welcome.heartbeat_s)
                nursery.start_soon(self.send_finished, out, control)
                nursery.start_soon(self.apply_updates, control)
                await control.ready(engine.version)
                async for msg in control:
                    match msg:
                        case Credits(group_ids=ids, min_versions=mins):
                            now = time.time()
                            for group_id, min_version in zip(ids, mins, strict=True):
                                engine.submit(task.prompt(group_id, run.samples_per_prompt, min_version), now)
                        case UpdateWeights():
                            self._wanted = msg
                            self._update.set()
                        case Evaluate():
                            nursery.start_soon(self.evaluate, msg, task, control)
                        case Shutdown(reason=reason):
                            self.say("shutting down (%s)", reason)
                            break
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await engine.close()

    def queues(self) -> dict[str, int]:
        return self.engine.queues() if self.engine is not None else {}

    async def send_finished(self, out: transport.Push, control: Control) -> None:
        """Send finished groups on, and tell the controller they left."""
        async for finished in self.engine.finished:
            while True:  # and whatever else has finished by now
                try:
                    finished += self.engine.finished.receive_nowait()
                except trio.WouldBlock:
                    break
            batch = build_batch(finished)
            await out.send(batch)
            self.counters["groups"] += len(finished)
            self.counters["samples"] += batch.n_samples
            self.counters["tokens"] += batch.n_tokens
            self.counters["failed_samples"] += len(batch.failures)
            self.counters["bytes_out"] = out.bytes_sent
            await control.send(Ack(stage=Stage.ROLLOUT_END, group_ids=batch.group_ids))

    async def apply_updates(self, control: Control) -> None:
        """Load each version the controller asks for, in order (a newer order
        replaces one not yet started); say at once if it is held already (an
        earlier fetch may have brought a newer version than it asked for)."""
        while True:
            await self._update.wait()
            self._update = trio.Event()
            msg, self._wanted = self._wanted, None
            if msg is None:
                continue
            if msg.version <= self.engine.version:
                await control.send(WeightsLoaded(version=self.engine.version, seconds=0.0))
                continue
            started = time.monotonic()
            self.version = await self.engine.update_weights(msg.version, msg.transfer)
            seconds = time.monotonic() - started
            self.counters["weight_updates"] += 1
            self.say("weights v%d loaded in %.0f ms", self.version, 1000 * seconds)
            await control.send(WeightsLoaded(version=self.version, seconds=seconds))

    async def evaluate(self, msg: Evaluate, task: Task, control: Control) -> None:
        """Answer every held-out prompt once, alongside training traffic."""
        started, version = time.monotonic(), self.engine.version
        prompts = task.heldout_prompts()
        responses: list[list[int] | None] = [None] * len(prompts)
        limit = trio.CapacityLimiter(self.engine.eval_concurrency)

        async def one(i: int) -> None:
            async with limit:
                responses[i] = await self.engine.complete(prompts[i], msg.temperature)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        metrics = task.heldout_metrics(responses)
        seconds = time.monotonic() - started
        self.say("eval v%d: accuracy %.3f over %d problems in %.1f s", version, metrics["accuracy"], len(prompts), seconds)
        await control.send(EvalDone(version=version, metrics=metrics, seconds=seconds, version_end=self.engine.version))
