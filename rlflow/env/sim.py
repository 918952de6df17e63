"""A simulated environment, for scale runs, tests and the bench: episodes of a
drawn number of turns, each step taking a drawn time (an async wait, as a
tool call or a remote environment would), with short text observations.

Every draw is a function of the run's seed and the episode (its group id,
index and turn), so that a step taken again gives the same answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import numpy as np

from rlflow.env.core import Episode, Step


class SimEnv:
    """Episodes of `min_turns` to `max_turns` turns (uniform), steps that take
    `latency` (a distribution table, as in the config: ``{kind = "lognormal",
    median = 0.5, sigma = 1.0, max = 30}``), observations of
    `observation_chars` characters, and a reward of 1 with probability
    `reward_p` at the last turn."""

    def __init__(self, *, min_turns: int = 1, max_turns: int = 4, latency: dict[str, Any] | None = None,
                 observation_chars: int = 16, prompt_chars: int = 32, reward_p: float = 0.5, seed: int = 0):
        from rlflow.config import Distribution, Fixed

        if not 1 <= min_turns <= max_turns:
            raise ValueError(f"need 1 <= min_turns <= max_turns, got {min_turns} and {max_turns}")
        self.min_turns, self.max_turns = min_turns, max_turns
        self.latency = msgspec.convert(latency, Distribution) if latency else Fixed(value=0.0)
        self.observation_chars, self.prompt_chars = observation_chars, prompt_chars
        self.reward_p, self.seed = reward_p, seed

    def reset(self, row: dict[str, Any]) -> str:
        return "p" * self.prompt_chars

    def turns(self, episode: Episode) -> int:
        """How many turns `episode` lasts."""
        rng = np.random.default_rng((self.seed, episode.group_id, episode.index))
        return int(rng.integers(self.min_turns, self.max_turns + 1))

    async def step(self, episode: Episode, turn: str) -> Step:
        from rlflow.distributions import draw

        rng = np.random.default_rng((self.seed, episode.group_id, episode.index, episode.turn))
        wait = float(draw(self.latency, rng))
        if wait > 0:
            await asyncio.sleep(wait)
        if episode.turn >= self.turns(episode):
            return Step(None, float(rng.random() < self.reward_p), True)
        return Step("o" * self.observation_chars, 0.0, False)
