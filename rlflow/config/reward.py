"""The reward role's tables: `[roles.reward]` and its engines (simulated, the task's verifier,
reward functions by import path, the environment's or the agents' own reward)."""

from __future__ import annotations

from typing import Literal, Union

from rlflow.config.base import Distribution, Fixed, NonNegInt, PosFloat, PosInt, StartedRole, Table
from rlflow.rewards.core import FunctionSpec


class SimReward(Table, tag_field="kind", tag="sim", frozen=True):
    """A simulated reward: a latency per sample, `concurrency` samples at a time."""

    latency_s: Distribution = Fixed(value=0.0)
    """Time to score one sample."""
    concurrency: PosInt = 64
    """Samples scored at once (per replica)."""


class TaskReward(Table, tag_field="kind", tag="task", frozen=True):
    """The task's own verifier (e.g. checking the final answer), per sample,
    in worker threads with a per-call timeout."""

    concurrency: PosInt = 8
    """Samples scored at once (per replica)."""
    timeout_s: PosFloat = 10.0
    """A sample whose scoring takes longer fails (recorded in-band, reward NaN)."""


class FunctionsReward(Table, tag_field="kind", tag="functions", frozen=True):
    """Reward functions named by import path ("package.module:function", e.g.
    "rlflow.rewards:math"), run in worker processes under a timeout per call;
    a sample's reward is the weighted sum of theirs."""

    functions: list[FunctionSpec]
    """The functions, each a table: path, and optionally name, weight, kwargs, timeout_s, workers."""
    concurrency: PosInt = 16
    """Samples scored at once (per replica); at least the functions' workers, to keep them busy."""
    on_failure: Literal["drop", "retry", "fallback"] = "drop"
    """A sample a function could not score (timeout, error, crash): drop its group for good (counted, never
    trained on), retry the call (`retries` times, then drop), or score it `fallback` for that function."""
    retries: PosInt = 1
    """Calls retried per sample with on_failure = "retry"."""
    fallback: float = 0.0
    """The value a failed call counts as with on_failure = "fallback"."""
    check_references: NonNegInt = 8
    """At start, score the reference answers of this many rows as if they were responses, and report a
    function that does not score them right (0: no check)."""
    start_timeout_s: PosFloat = 120.0
    """How long the functions' workers may take to start (importing the functions, loading models)."""


class EnvReward(Table, tag_field="kind", tag="env", frozen=True):
    """The environment's own reward: the sum of its rewards over an episode's
    turns, times `roles.env.reward_weight` (a run with `[roles.env]`); or the
    reward each outside agent gave its episode (a run with `[agents]`). With
    the `functions` engine instead, the functions' reward and this one add up."""

    concurrency: PosInt = 64
    """Samples scored at once (per replica)."""


RewardEngine = Union[SimReward, TaskReward, FunctionsReward, EnvReward]


class RewardRole(StartedRole, frozen=True):
    """The role that scores responses."""

    engine: RewardEngine = SimReward()
    """How rewards are computed."""
    inline: bool = False
    """Score in the rollout process instead, in line with generation (what AReaL and slime do): its
    engine waits while each finished group is scored, and the reward replicas pass batches on. A layout
    to compare against (bench/reward.py); the simulated rollout only."""
