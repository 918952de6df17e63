"""The trainer service: consumes groups, takes optimizer steps, publishes weights.

Its loop: wait until a step's worth of groups (`run.batch_size`) has
arrived, dropping duplicates (a reissued group that arrives twice), failed
samples and, with the strict staleness check, groups too stale to train on
(those are reported as `Expired` so that the controller reissues them);
train;
publish policy version v+1 and tell the controller (`WeightsReady`), then
acknowledge the step's groups (`StepDone`). It never waits for the rollout
to load the new weights: it sends them when the controller says so
(`SendWeights`). Groups are taken off the stream the moment they arrive,
also while a step trains, so that a training step never holds up the roles
upstream (the credits bound how many can be outstanding).
"""

from __future__ import annotations

import json
import time

import numpy as np
import trio

from rlflow.algo.staleness import too_stale
from rlflow.data import transport
from rlflow.protocol import (
    Expired,
    SampleBatch,
    SendWeights,
    Shutdown,
    Stage,
    StepDone,
    WeightsReady,
    WeightsZmq,
    concat,
    split,
    stamp,
    take,
)
from rlflow.services.base import Control, Service, bind_host
from rlflow.services.trainer.engine import TrainerEngine, make_engine


class TrainerService(Service):
    """Trains on what the stream brings, within the staleness bound."""

    def __init__(self, spec):
        super().__init__(spec)
        self.step = 0
        self.acked: set[int] = set()
        self.buffer: list[SampleBatch] = []
        #: Ids of the groups in `buffer` or in the step being trained: one that arrives again meanwhile is a duplicate.
        self._held: set[int] = set()
        #: Group id -> the policy version of its oldest token, for the groups held that have tokens.
        self._first: dict[int, int] = {}
        self._arrived = trio.Event()
        self.engine: TrainerEngine | None = None

    def queues(self) -> dict[str, int]:
        return {"groups": len(self.buffer)}

    async def main(self, control: Control) -> None:
        engine = self.engine = await make_engine(self.context())
        async with (
            transport.open_pull(bind=transport.tcp_address(bind_host(self.config)), name=f"{self.spec.name}/in") as inbox,
            trio.open_nursery() as nursery,
        ):
            self.sockets.append(inbox)
            await nursery.start(engine.serve)
            weights, layout = engine.offer()
            endpoints = {"in": transport.bound_address(inbox)}
            if isinstance(weights, WeightsZmq):
                endpoints["weights"] = weights.address
            welcome = await control.hello(endpoints=endpoints, weights=weights, layout=layout)
            self.step = self.version = welcome.version  # above 0 when resuming
            await engine.connect(welcome.weights)
            self.say("up, engine %s", type(engine).__name__)
            nursery.start_soon(control.heartbeats, self.heartbeat, welcome.heartbeat_s)
            nursery.start_soon(self.receive, inbox, control)
            nursery.start_soon(self.train, inbox, control)
            await control.ready(self.version)
            async for msg in control:
                match msg:
                    case SendWeights(version=version, transfer=transfer):
                        nursery.start_soon(engine.send, version, transfer)
                    case Shutdown(reason=reason):
                        self.say("shutting down (%s)", reason)
                        break
            nursery.cancel_scope.cancel()

    async def train(self, inbox: transport.Pull, control: Control) -> None:
        run = self.config.run
        while self.step < run.steps:
            groups = await self.collect(inbox, control, run.batch_size)
            batch = concat(groups)
            versions = batch.versions.numpy()
            # Versions behind the trainer's, per token (from the extremes: no array as long as the batch).
            staleness = (self.version - versions.mean(), self.version - versions.min()) if versions.size else (0.0, 0.0)
            self._record_lengths(batch, [self._oldest(g) for g in groups])
            with self.clock.state("busy"):
                started = time.monotonic()
                metrics = await self.engine.train(batch)
                metrics["train_s"] = time.monotonic() - started
            self.step += 1
            self.version = self.step
            with self.clock.state("loading"):
                nbytes = await self.engine.publish(self.version)
            await control.send(WeightsReady(version=self.version, nbytes=nbytes))
            every = self.engine.checkpoint_every
            if self.run_dir is not None and (self.step == run.steps or (every and self.step % every == 0)):
                with self.clock.state("loading"):
                    saved = await self.engine.save(self.run_dir.checkpoint(self.step), {"step": self.step, "version": self.version})
                if saved:
                    metrics["checkpoint"] = float(self.step)
            rewards = batch.rewards.numpy() if batch.rewards is not None else np.zeros(0)
            ids = batch.group_ids
            self.acked.update(ids)
            self._release(ids)
            metrics.update(
                samples=float(batch.n_samples),
                tokens=float(batch.n_tokens),
                reward_mean=float(np.nanmean(rewards)) if rewards.size else float("nan"),
                staleness_mean=float(staleness[0]),
                staleness_max=float(staleness[1]),
            )
            self.counters["samples"] += batch.n_samples
            self.counters["tokens"] += batch.n_tokens
            await control.send(StepDone(step=self.step - 1, version=self.version, acked=ids, metrics=metrics))
        self.clock.set("idle")

    def _record_lengths(self, batch: SampleBatch, oldest: list[int]) -> None:
        """Per step: the response lengths (for `rlflow plan` to replay) and,
        per group, its id and the oldest policy version of its tokens."""
        if self.run_dir is None:
            return
        path = self.run_dir.lengths(self.spec.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "step": self.step,
            "lengths": np.diff(batch.response_offsets.numpy()).tolist(),
            "groups": batch.group_ids,
            "oldest": oldest,
        }
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    async def receive(self, inbox: transport.Pull, control: Control) -> None:
        """Add every group to the buffer as it arrives."""
        async for msg in inbox:
            await self._accept(msg, control)
            self._arrived.set()

    async def collect(self, inbox: transport.Pull, control: Control, want: int) -> list[SampleBatch]:
        """The next `want` groups fit to train on, oldest policy first.

        Everything already delivered is in the buffer, so that the groups
        closest to the staleness bound are trained on before they pass it.
        With `staleness_check = "strict"`, groups that have passed it are
        dropped and reported for reissue (also those that waited here
        across a step).
        """
        while True:
            while (msg := inbox.recv_nowait()) is not None:  # what `receive` has not got to yet
                await self._accept(msg, control)
            await self._drop_stale(control)
            if len(self.buffer) >= want:
                break
            self._arrived = trio.Event()
            with self.clock.state("starved"):
                await self._arrived.wait()
        self.buffer.sort(key=self._oldest)
        taken, self.buffer = self.buffer[:want], self.buffer[want:]
        return taken

    def _oldest(self, group: SampleBatch) -> int:
        """The policy version of a group's oldest token."""
        return self._first.get(group.groups[0].group_id, self.version)

    def _release(self, group_ids: list[int]) -> None:
        """These groups are no longer held (trained on, or dropped)."""
        self._held.difference_update(group_ids)
        for group_id in group_ids:
            self._first.pop(group_id, None)

    async def _drop_stale(self, control: Control) -> None:
        """Strict check: drop buffered groups past the bound, for reissue."""
        if self.config.run.staleness_check != "strict":
            return
        k = self.config.run.staleness
        keep, expired = [], []
        for group in self.buffer:
            (expired if too_stale(self._oldest(group), self.version, k) else keep).append(group)
        self.buffer = keep
        self._release([g.groups[0].group_id for g in expired])
        if expired:
            self.counters["stale_groups"] += len(expired)
            await control.send(Expired(group_ids=[g.groups[0].group_id for g in expired], reason="stale"))

    async def _accept(self, msg, control: Control) -> None:
        """Add the groups of one message to the buffer (checked, deduplicated)."""
        msg = self.checked_batch(msg)
        if msg is None:
            return
        failed_groups: list[int] = []
        for group in split(stamp(msg, Stage.TRAINER_RECEIVED, time.time())):
            group_id = group.groups[0].group_id
            if group_id in self.acked or group_id in self._held:
                self.counters["duplicates"] += 1
                continue
            failed = {f.index for f in group.failures}
            if failed:
                self.counters["failed_samples"] += len(failed)
                group = take(group, [i for i in range(group.n_samples) if i not in failed])
            if group.n_samples == 0:
                failed_groups.append(group_id)
                continue
            self.buffer.append(group)
            self._held.add(group_id)
            if group.n_tokens:
                self._first[group_id] = int(group.versions.numpy().min())
        if failed_groups:
            await control.send(Expired(group_ids=failed_groups, reason="every sample failed"))
