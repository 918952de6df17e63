"""Tasks: where prompts come from and how answers are scored.

A task turns a group id into a prompt, deterministically (from the run's
seed), so that the controller hands out ids, never data, and a group that has
to be reissued is the same prompt again. The rollout role asks the task for
prompts; the reward role asks it for scores.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from rlflow.config import Config, SimTask
from rlflow.protocol import GroupInfo, PromptGroup


class Task(Protocol):
    name: str

    def prompt(self, group_id: int, n: int, min_version: int = 0) -> PromptGroup:
        """The prompt of group `group_id`, to be answered `n` times."""
        ...

    def score(self, group: GroupInfo, index: int, response_ids: np.ndarray) -> tuple[float, dict[str, float]]:
        """Reward of one response, and its named components."""
        ...


class SimTaskImpl:
    """Random token prompts; each answer is right with probability `reward_p`."""

    name = "sim"

    def __init__(self, cfg: SimTask, seed: int):
        self.cfg = cfg
        self.seed = seed

    def prompt(self, group_id: int, n: int, min_version: int = 0) -> PromptGroup:
        rng = np.random.default_rng((self.seed, group_id))
        ids = rng.integers(0, self.cfg.vocab_size, self.cfg.prompt_len)
        return PromptGroup(group_id=group_id, prompt_ids=ids.tolist(), n=n, task=self.name, min_version=min_version)

    def score(self, group: GroupInfo, index: int, response_ids: np.ndarray) -> tuple[float, dict[str, float]]:
        rng = np.random.default_rng((self.seed, group.group_id, index, 1))
        correct = float(rng.random() < self.cfg.reward_p)
        return correct, {"correct": correct}


def make_task(config: Config) -> Task:
    """The task the config names."""
    match config.task:
        case SimTask() as cfg:
            return SimTaskImpl(cfg, config.run.seed)
    raise ValueError(f"unknown task {config.task!r}")
