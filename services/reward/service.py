"""The reward service: scores every response of a batch and passes it on.

Scoring is per sample and concurrent (up to the engine's `concurrency`
samples per replica); a simulated score that takes no time is computed in
place, without a task of its own. A sample whose scoring fails or times out keeps its
row, gets NaN as its reward and an entry in the batch's `failures`: it is
counted, never turned into a made-up value.
"""

from __future__ import annotations

import time

import numpy as np
import trio

from rlflow.config import SimReward, TaskReward
from rlflow.protocol import SampleBatch, SampleFailure, Stage, Tensor, samples, stamp
from rlflow.services.base import StageService
from rlflow.distributions import draw


class RewardService(StageService):
    """Fills in `rewards` and `reward_details`."""

    def __init__(self, spec):
        super().__init__(spec)
        self.engine = spec.config.roles.reward.engine
        self.task = self.load_task()
        self.rng = np.random.default_rng((spec.config.run.seed, spec.rank, 11))
        self.limiter = trio.CapacityLimiter(self.engine.concurrency)
        # Enough whole batches in flight to keep `concurrency` samples busy.
        self.max_batches = max(1, self.engine.concurrency // spec.config.run.samples_per_prompt) + 1

    async def process(self, batch: SampleBatch) -> SampleBatch:
        rows = list(samples(batch))
        rewards = np.full(len(rows), np.nan, dtype=np.float32)
        details: dict[str, np.ndarray] = {}
        failures: list[SampleFailure] = []
        delays = self.delays(len(rows))

        def scored(i: int, value: float, parts: dict[str, float]) -> None:
            rewards[i] = value
            for key, part in parts.items():
                if key not in details:
                    details[key] = np.full(len(rows), np.nan, dtype=np.float32)
                details[key][i] = part

        def failed(i: int, exc: Exception) -> None:  # per-sample: recorded in-band, the service goes on
            failures.append(SampleFailure(index=i, stage=Stage.REWARD_END, kind=type(exc).__name__, message=str(exc)[:200]))
            self.counters["failed_samples"] += 1

        async def one(i: int, delay: float | None) -> None:
            async with self.limiter:
                try:
                    value, parts = await self.score(rows[i], delay)
                except Exception as exc:
                    failed(i, exc)
                    return
            scored(i, value, parts)

        failed_before = {f.index for f in batch.failures}  # e.g. a request the engine could not generate
        async with trio.open_nursery() as nursery:
            for i in range(len(rows)):
                if i in failed_before:
                    continue
                delay = None if delays is None else float(delays[i])
                if delay is not None and delay <= 0:
                    # A simulated score that takes no time needs no task of
                    # its own (at scale, thousands of samples a second).
                    try:
                        value, parts = self.task.score(rows[i].group, rows[i].index, rows[i].response_ids)
                    except Exception as exc:
                        failed(i, exc)
                        continue
                    scored(i, value, parts)
                else:
                    nursery.start_soon(one, i, delay)
        failures.sort(key=lambda f: f.index)
        return stamp(
            batch,
            Stage.REWARD_END,
            time.time(),
            rewards=Tensor.from_numpy(rewards),
            reward_details={k: Tensor.from_numpy(v) for k, v in sorted(details.items())},
            failures=[*batch.failures, *failures],
        )

    def delays(self, n: int) -> np.ndarray | None:
        """The simulated reward's latency for each of `n` samples (None: a real reward)."""
        match self.engine:
            case SimReward(latency_s=latency):
                return draw(latency, self.rng, n)
        return None

    async def score(self, row, delay: float | None) -> tuple[float, dict[str, float]]:
        match self.engine:
            case SimReward():
                await trio.sleep(delay)
                return self.task.score(row.group, row.index, row.response_ids)
            case TaskReward(timeout_s=timeout):
                with trio.move_on_after(timeout):
                    # A verifier that hangs is abandoned (its thread finishes
                    # on its own); the sample fails with a timeout.
                    return await trio.to_thread.run_sync(
                        self.task.score, row.group, row.index, row.response_ids, abandon_on_cancel=True
                    )
                raise TimeoutError(f"scoring took longer than roles.reward.engine.timeout_s = {timeout:g} s")
        raise ValueError(f"unknown reward engine {self.engine!r}")
