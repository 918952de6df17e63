"""Scoring a batch: the reward engines' work, for the reward service (and
for a rollout that scores in line, `roles.reward.inline`).

Per sample and concurrent (up to the engine's `concurrency` samples); a
simulated score that takes no time is computed in place, without a task of
its own, and the simulated latencies are drawn once per batch. A
sample whose scoring fails keeps its row, gets NaN as its reward and an
entry in the batch's `failures` naming the function and why.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import trio

from rlflow.config import EnvReward, Fixed, FunctionsReward, SimReward, TaskReward
from rlflow.distributions import draw
from rlflow.protocol import SampleBatch, SampleFailure, SampleView, Stage, Tensor, samples, stamp
from rlflow.rewards import Sample, Status


class Scorer:
    """Fills in a batch's `rewards`, `reward_details` and failures."""

    def __init__(self, engine: Any, task: Any, counters: Counter[str], seed: tuple[int, ...],
                 env_weight: float | None = None):
        """`env_weight`: the weight of an episode's environment rewards in its reward (None: no environment)."""
        self.engine = engine
        self.env_weight = env_weight
        self.task = task
        self.counters = counters
        self.rng = np.random.default_rng(seed)
        self.limiter = trio.CapacityLimiter(engine.concurrency)
        #: The reward functions' worker pool (`functions` engine), set by the service.
        self.pool = None

    async def score(self, batch: SampleBatch) -> tuple[SampleBatch, list[SampleFailure]]:
        """The scored batch, and the failures this scoring added."""
        if (whole := self._score_all(batch)) is not None:
            return whole, []
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
            if isinstance(exc, ScoringFailed):
                failures.append(SampleFailure(index=i, stage=Stage.REWARD_END, kind=exc.kind, message=exc.message))
            else:  # the task's own verifier, which raises
                failures.append(SampleFailure(index=i, stage=Stage.REWARD_END, kind=type(exc).__name__,
                                              message=str(exc)[:200]))

        async def one(i: int, delay: float | None) -> None:
            async with self.limiter:
                try:
                    value, parts = await self.score_one(rows[i], delay)
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
                if isinstance(self.engine, EnvReward):
                    scored(i, 0.0, {})  # the environment's reward alone, added below
                elif delay is not None and delay <= 0:
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
        if batch.env_rewards is not None and self.env_weight is not None:
            add_env_rewards(rewards, details, batch.env_rewards.numpy(), self.env_weight)
        self.counters["scored_samples"] += len(rows) - len(failed_before)
        self.counters["failed_samples"] += len(failures)
        out = stamp(
            batch,
            Stage.REWARD_END,
            time.time(),
            rewards=Tensor.from_numpy(rewards),
            reward_details={k: Tensor.from_numpy(v) for k, v in sorted(details.items())},
            failures=[*batch.failures, *failures],
        )
        return out, failures

    def _score_all(self, batch: SampleBatch) -> SampleBatch | None:
        """The batch scored at once, where the task can (`score_all`), the reward takes no time and no
        sample has failed; else None."""
        score_all = getattr(self.task, "score_all", None)
        instant = isinstance(self.engine, SimReward) and self.engine.latency_s == Fixed(value=0.0)
        if score_all is None or not instant or batch.failures or batch.env_rewards is not None:
            return None
        sizes = [g.size for g in batch.groups]
        group_ids = np.repeat(np.fromiter((g.group_id for g in batch.groups), np.int64, len(sizes)), sizes)
        indices = batch.sample_index.numpy()
        parts = score_all(group_ids, indices)
        self.counters["scored_samples"] += batch.n_samples
        rewards = parts.pop("reward")
        return stamp(batch, Stage.REWARD_END, time.time(), rewards=Tensor.from_numpy(rewards),
                     reward_details={k: Tensor.from_numpy(v) for k, v in sorted(parts.items())})

    def delays(self, n: int) -> np.ndarray | None:
        """The simulated reward's latency for each of `n` samples, drawn at
        once (None: not the simulated reward)."""
        match self.engine:
            case SimReward(latency_s=latency):
                return draw(latency, self.rng, n)
        return None

    async def score_one(self, row: SampleView, delay: float | None = None) -> tuple[float, dict[str, float]]:
        """One row's reward and its parts (`delay`: the simulated reward's latency)."""
        match self.engine:
            case SimReward(latency_s=latency):
                if delay is None:
                    delay = draw(latency, self.rng)
                if delay > 0:
                    await trio.sleep(delay)
                return self.task.score(row.group, row.index, row.response_ids)
            case TaskReward(timeout_s=timeout):
                with trio.move_on_after(timeout):
                    # A verifier that hangs is abandoned (its thread finishes
                    # on its own); the sample fails with a timeout.
                    return await trio.to_thread.run_sync(
                        self.task.score, row.group, row.index, row.response_ids, abandon_on_cancel=True
                    )
                raise ScoringFailed(
                    "timeout", f"scoring took longer than roles.reward.engine.timeout_s = {timeout:g} s"
                )
            case FunctionsReward() as cfg:
                return await self._functions(cfg, sample_of(self.task, row))
        raise ValueError(f"unknown reward engine {self.engine!r}")

    async def _functions(self, cfg: FunctionsReward, sample: Sample) -> tuple[float, dict[str, float]]:
        attempts = 1 + (cfg.retries if cfg.on_failure == "retry" else 0)
        for attempt in range(attempts):
            scored = await self.pool.score(sample)
            for result in scored:
                self.counters[f"reward.{result.function}.{result.status.value}"] += 1
            combined = self.pool.combine(scored)
            if combined.reward is not None:
                if cfg.on_failure == "fallback":  # the same columns whether or not a call failed
                    return fallback(scored, self.pool.specs, cfg.fallback)
                return combined.reward, combined.details
            if attempt + 1 < attempts:
                self.counters["reward_retries"] += 1
        if cfg.on_failure == "fallback":
            return fallback(scored, self.pool.specs, cfg.fallback)
        # The failure that fails the sample (a function of weight 0 is only logged).
        first = next(r for r, spec in zip(scored, self.pool.specs, strict=True)
                     if spec.weight != 0 and r.status is not Status.OK)
        raise ScoringFailed(f"{first.function}:{first.status.value}", first.message[:300])


def add_env_rewards(rewards: np.ndarray, details: dict[str, np.ndarray], per_turn: np.ndarray, weight: float) -> None:
    """Add each episode's environment rewards (summed over its turns, times `weight`) to its reward
    (where it has one), and each turn's as a detail (``env`` the sum, ``env.turn<k>`` turn k, NaN past
    an episode's last turn)."""
    total = np.nansum(per_turn, axis=1).astype(np.float32)
    scored = ~np.isnan(rewards)
    rewards[scored] += weight * total[scored]
    details["env"] = np.where(scored, total, np.nan).astype(np.float32)
    for k in range(per_turn.shape[1]):
        details[f"env.turn{k + 1}"] = per_turn[:, k].astype(np.float32)


class ScoringFailed(Exception):
    """A sample could not be scored; `kind` and `message` go in-band."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


def fallback(scored: list, specs: tuple, value: float) -> tuple[float, dict[str, float]]:
    """The weighted sum with each failed function counted as `value` (and
    marked "<name>.failed" = 1 in the details; 0 where it scored)."""
    total, details = 0.0, {}
    for result, spec in zip(scored, specs, strict=True):
        ok = result.status is Status.OK and result.value is not None
        if spec.weight == 0 and not ok:
            continue  # logged only
        total += spec.weight * (result.value if ok else value)
        details[spec.name] = result.value if ok else value
        details[f"{spec.name}.failed"] = 0.0 if ok else 1.0
        if ok:
            details.update({f"{spec.name}.{k}": v for k, v in result.parts.items()})
    return total, details


def sample_of(task: Any, row: SampleView) -> Sample:
    """What a reward function sees of one row of a batch (an episode: every turn)."""
    group_id = row.group.group_id
    turns: list[str] = []
    observations: list[str] = []
    if row.loss_mask is not None:
        # Runs of the mask: the model's turns (1) and what it was shown between them (0).
        edges = np.flatnonzero(np.diff(row.loss_mask.astype(np.int8))) + 1
        for part, mask in zip(np.split(row.response_ids, edges), np.split(row.loss_mask, edges)):
            if len(part):
                (turns if mask[0] else observations).append(task.decode(part))
    return Sample(
        prompt=task.decode(row.prompt_ids) if row.loss_mask is not None else task.prompt_text(group_id),
        # The rollout's text where it sent it (the same decode), else decoded here.
        response=row.response_text if row.response_text is not None else task.decode(row.response_ids),
        response_ids=tuple(row.response_ids.tolist()),
        reference=row.group.reference,
        row=dict(task.row(group_id)),
        turns=tuple(turns),
        observations=tuple(observations),
    )
