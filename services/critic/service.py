"""The critic service: a learned value function in the stream, between the
roles that score samples and the trainer.

Its loop is the shared stage loop (`StageService`: receive, work, send, over
shared memory between services of one machine), one piece of work at a time
on rank 0: for each batch that arrives, the value before every response token
with its current weights, then GAE advantages and returns from those values
and the per-token rewards (the sample's reward at its last token, less the
run's KL penalty at each token where the run puts it in the reward),
attached as columns with the critic version that made them, and the batch
sent on to the trainer; then, each time a step's worth of groups
(`run.batch_size`) has gone by, one optimizer step on them (its own work,
while no batch waits), while the trainer takes its own step on them. It
computes values for new batches while at most `max_steps_owed` of its steps
are owed, so the trainer does not wait for a critic step, and the values it
gets lag the critic's stream by a bounded number of steps (the trainer
reports by how many versions, per step).

Failed samples keep their rows with NaN columns and are not trained on.
The critic saves its checkpoint at the trainer's checkpoint steps (its own
step count), and resumes from the one beside the trainer's; at shutdown it
first takes the steps it owes. Ranks above 0 have no stream: they follow
rank 0's work (see the engine). A lost critic rank, like a lost trainer
rank, ends the run, which resumes from its checkpoints.
"""

from __future__ import annotations

import math
import time

import numpy as np
import trio

from rlflow.algo.values import batch_gae
from rlflow.config import TorchTrainer
from rlflow.protocol import Heartbeat, SampleBatch, Shutdown, Stage, Tensor, concat, split, stamp, take
from rlflow.services.base import Control, StageService
from rlflow.services.critic.engine import CriticEngine, make_engine


class CriticService(StageService):
    """Attaches values, advantages and returns; trains on what passes (the shared stage loop, with a
    training step as its own work)."""

    lead_only = True

    def __init__(self, spec):
        super().__init__(spec)
        self.role = self.config.roles.critic
        self.engine: CriticEngine | None = None
        #: Groups sent on, not yet trained on (with their values and returns), in order.
        self.pending: list[SampleBatch] = []

    @property
    def owed(self) -> int:
        """Steps whose groups have all gone by and that are not taken yet."""
        return len(self.pending) // self.config.run.batch_size

    def queues(self) -> dict[str, int]:
        return {**super().queues(), "owed": self.owed} if self.lead else {}

    def heartbeat(self, seq: int) -> Heartbeat:
        if self.engine is not None:  # a rank above 0 steps with rank 0, in its engine
            self.version = self.engine.version
        return super().heartbeat(seq)

    async def main(self, control: Control) -> None:
        engine = self.engine = await make_engine(self.context())
        self.version = engine.version
        try:
            await super().main(control)
        finally:
            with trio.move_on_after(60) as scope:
                scope.shield = True
                await engine.close()

    async def follow(self, control: Control) -> None:
        """A rank above 0: rank 0's work, until it says stop or the run ends."""
        welcome = await control.hello(endpoints={})
        self.say("up, rank %d of %d, following rank 0", self.spec.rank, self.spec.replicas)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(control.heartbeats, self.heartbeat, welcome.heartbeat_s)
            followed = trio.Event()

            async def work() -> None:
                await self.engine.follow()
                followed.set()

            nursery.start_soon(work)
            await control.ready(self.version)
            async for msg in control:
                if isinstance(msg, Shutdown):
                    with trio.move_on_after(30):  # rank 0 takes the steps it owes, then says stop
                        await followed.wait()
                    break
            nursery.cancel_scope.cancel()

    async def process(self, batch: SampleBatch) -> SampleBatch:
        """`batch` valued, after the steps owed past `max_steps_owed` (values never lag further)."""
        while self.owed > self.role.max_steps_owed:
            await self.step()
        return await self.value(batch)

    async def sent(self, batch: SampleBatch) -> None:
        """Keep what the trainer will train on, to train on it too; a step's worth makes a step due."""
        for group in split(batch):
            rows = _trainable(group)
            if rows:
                self.pending.append(take(group, rows))
        if self.owed:
            self.work_due()

    async def idle(self) -> bool:
        """Nothing to value: take a step owed, if there is one."""
        if not self.owed:
            return False
        await self.step()
        return True

    async def finish(self) -> None:
        """At shutdown: the steps owed, and no more."""
        self.say("steps owed: %d", self.owed)
        while self.owed:
            await self.step()
        self.clock.set("idle")

    async def value(self, batch: SampleBatch) -> SampleBatch:
        """`batch` with the critic's columns (see the module)."""
        started = time.monotonic()
        values = await self.engine.values(batch)
        self.counters["value_s"] += time.monotonic() - started
        advantages, returns = self.advantages(batch, values)
        self.counters["tokens"] += batch.n_tokens
        return stamp(
            batch, Stage.CRITIC_END, time.time(),
            values=Tensor.from_numpy(values.astype(np.float32)),
            returns=Tensor.from_numpy(returns),
            token_advantages=Tensor.from_numpy(advantages),
            critic_versions=Tensor.from_numpy(np.full(batch.n_samples, self.version, np.int32)),
        )

    def advantages(self, batch: SampleBatch, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 [T] advantages and returns by GAE (NaN for failed samples),
        the run's KL penalty on every token where it puts it in the reward."""
        trainer = self.config.roles.trainer.engine
        penalty = None
        if isinstance(trainer, TorchTrainer) and trainer.kl_coef > 0 and trainer.kl_in == "reward":
            if batch.teacher_logprobs is None:
                raise ValueError("the run puts a KL penalty into the reward, and a batch without "
                                 "teacher_logprobs reached the critic")

            def penalty(row) -> np.ndarray:
                return trainer.kl_coef * _kl(row.logprobs, row.teacher_logprobs, trainer.kl_estimator)

        return batch_gae(batch, values, self.role.gamma, self.role.lam, penalty)

    async def step(self) -> None:
        """One optimizer step on the oldest step's worth of groups sent on. A step begun ends, with its
        checkpoint, whatever cancels the loop that took it (every rank is in it)."""
        size = self.config.run.batch_size
        batch, self.pending = concat(self.pending[:size]), self.pending[size:]
        with trio.CancelScope(shield=True):
            with self.clock.state("busy"):
                started = time.monotonic()
                stats = await self.engine.train(batch)
                seconds = time.monotonic() - started
            self.version = self.engine.version
            self.counters["critic_step_s"] += seconds
            self.counters["critic_steps"] += 1
            self.counters["critic_tokens"] += batch.n_tokens
            self.say("step %d: value loss %.4g, %.2f s", self.version, stats.get("value_loss", math.nan), seconds)
            await self._checkpoint()

    async def _checkpoint(self) -> None:
        """A checkpoint at the trainer's checkpoint steps (in the critic's own count)."""
        every = self.config.roles.trainer.engine.checkpoint_every
        if self.run_dir is None or not (self.version == self.config.run.steps or (every and self.version % every == 0)):
            return
        with self.clock.state("loading"):
            await self.engine.save(self.run_dir.role_checkpoint("critic", self.version),
                                   {"version": self.version})


def _trainable(group: SampleBatch) -> list[int]:
    """Rows of a group sent on that the critic trains on (not failed, with a return)."""
    failed = {f.index for f in group.failures}
    returns = group.returns.numpy()
    offsets = group.response_offsets.numpy()
    return [i for i in range(group.n_samples)
            if i not in failed and np.isfinite(returns[offsets[i]:offsets[i + 1]]).all()]


def _kl(logprobs: np.ndarray, reference: np.ndarray, estimator: str) -> np.ndarray:
    """Per token, the run's estimate of KL(policy || reference) (see `rlflow.algo.losses.kl_to_reference`)."""
    import torch  # only runs that put a KL penalty into the reward need it

    from rlflow.algo.losses import kl_to_reference

    return kl_to_reference(torch.from_numpy(np.asarray(logprobs, np.float32)),
                           torch.from_numpy(np.asarray(reference, np.float32)), estimator).numpy()
