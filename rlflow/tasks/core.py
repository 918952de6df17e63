"""Tasks: where prompts come from and how answers are scored.

Tasks: ``sim`` (random tokens, random rewards: for simulated runs),
``arith`` (the embedded default: addition written out column by column,
verifiable, with long-tailed response lengths), ``dataset`` (the user's own
files) and ``reasoning_gym`` (procedural problems), see `dataset`.

A task turns a group id into a prompt, deterministically (from the run's
seed), so that the controller hands out ids, never data, and a group that has
to be reissued is the same prompt again. The rollout role asks the task for
prompts; the reward role asks it for scores.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from rlflow.config import ArithTask, Config, DatasetTask, ReasoningGymTask, SimTask
from rlflow.protocol import GroupInfo, PromptGroup
from rlflow.tasks.arith import Arith
from rlflow.tasks.dataset import DatasetTaskImpl, ReasoningGymTaskImpl


class Task(Protocol):
    name: str
    scored_by_functions: bool
    """True: its answers are scored by the reward role's functions (it has no
    verifier of its own, and its held-out answers are scored by them too)."""

    def prompt(self, group_id: int, n: int, min_version: int = 0) -> PromptGroup:
        """The prompt of group `group_id`, to be answered `n` times."""
        ...

    def score(self, group: GroupInfo, index: int, response_ids: np.ndarray) -> tuple[float, dict[str, float]]:
        """Reward of one response, and its named components (tasks scored by
        reward functions raise)."""
        ...

    def row(self, group_id: int) -> Mapping[str, Any]:
        """What reward functions get as the group's dataset row."""
        ...

    def prompt_text(self, group_id: int) -> str:
        """The group's prompt, as the model sees it."""
        ...

    def decode(self, ids: np.ndarray) -> str:
        """A response's text."""
        ...


class SimTaskImpl:
    """Random token prompts; each answer is right with probability `reward_p`."""

    name = "sim"
    scored_by_functions = False

    def __init__(self, cfg: SimTask, seed: int):
        self.cfg = cfg
        self.seed = seed
        # Prompts are slices of tokens drawn once, at a place that depends on
        # the group id alone (a generator seeded per group costs tens of
        # microseconds, and a simulated cluster asks for thousands a second).
        self._tokens = np.random.default_rng((seed, 3)).integers(0, cfg.vocab_size, max(1 << 16, 2 * cfg.prompt_len))

    def prompt(self, group_id: int, n: int, min_version: int = 0) -> PromptGroup:
        start = int(_uniform(self.seed, group_id) * (len(self._tokens) - self.cfg.prompt_len))
        ids = self._tokens[start : start + self.cfg.prompt_len].tolist()
        return PromptGroup(group_id=group_id, prompt_ids=ids, n=n, task=self.name, min_version=min_version)

    def score(self, group: GroupInfo, index: int, response_ids: np.ndarray) -> tuple[float, dict[str, float]]:
        correct = float(_uniform(self.seed, group.group_id, index) < self.cfg.reward_p)
        return correct, {"correct": correct}

    def score_all(self, group_ids: np.ndarray, indices: np.ndarray) -> dict[str, np.ndarray]:
        """`score` of many samples at once (their groups' ids and their indices in them): the rewards and
        their parts, as `score` gives them one by one (a simulated cluster scores thousands a second)."""
        correct = (uniform_all(self.seed, group_ids, indices) < self.cfg.reward_p).astype(np.float32)
        return {"reward": correct, "correct": correct}

    def row(self, group_id: int) -> Mapping[str, Any]:
        return {}

    def prompt_text(self, group_id: int) -> str:
        return ""

    def decode(self, ids: np.ndarray) -> str:
        return " ".join(str(i) for i in ids.tolist())


_MASK64 = (1 << 64) - 1


def _uniform(*keys: int) -> float:
    """A number in [0, 1) that depends on `keys` alone: splitmix64 over them.
    Scoring draws one per sample; a numpy generator seeded per sample costs
    tens of microseconds, this one or two."""
    x = 0
    for key in keys:
        x = (x + (key & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return (x >> 11) / (1 << 53)


def uniform_all(*keys: int | np.ndarray) -> np.ndarray:
    """`_uniform` of many keys at once: integers and arrays of one length, element by element (numpy's
    unsigned arithmetic wraps as the masks do)."""
    x = np.zeros(max((np.size(k) for k in keys), default=0), dtype=np.uint64)
    for key in keys:
        x += key.astype(np.int64).view(np.uint64) if isinstance(key, np.ndarray) else np.uint64(key & _MASK64)
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class ArithTaskImpl:
    """`Arith` behind the `Task` interface: prompts as token ids, scores from ids."""

    name = "arith"
    scored_by_functions = False

    def __init__(self, cfg: ArithTask, seed: int, tokenizer):
        self.cfg = cfg
        self.arith = Arith(cfg.digit_weights, seed=seed, heldout_size=cfg.heldout_size, heldout_seed=cfg.heldout_seed)
        self.tokenizer = tokenizer

    def prompt(self, group_id: int, n: int, min_version: int = 0) -> PromptGroup:
        a, b = self.arith.training_problem(group_id)
        ids = self.tokenizer.encode(Arith.prompt_text(a, b), add_special_tokens=False)
        return PromptGroup(
            group_id=group_id, prompt_ids=list(ids), n=n, reference=str(a + b), task=self.name, min_version=min_version
        )

    def score(self, group: GroupInfo, index: int, response_ids: np.ndarray) -> tuple[float, dict[str, float]]:
        return self.arith.check(group.reference, self.decode(response_ids))

    def row(self, group_id: int) -> Mapping[str, Any]:
        a, b = self.arith.training_problem(group_id)
        return {"a": a, "b": b}

    def prompt_text(self, group_id: int) -> str:
        return Arith.prompt_text(*self.arith.training_problem(group_id))

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    def heldout_prompts(self) -> list[list[int]]:
        """Token ids of every held-out prompt."""
        return [
            self.tokenizer.encode(Arith.prompt_text(a, b), add_special_tokens=False) for a, b in self.arith.heldout
        ]

    def heldout_rows(self) -> list[tuple[dict[str, Any], str]]:
        """(row, reference answer) of every held-out problem (the episodes of an environment)."""
        return [({"a": a, "b": b}, str(a + b)) for a, b in self.arith.heldout]

    def heldout_metrics(self, responses: list[list[int]]) -> dict[str, float]:
        """Accuracy on the held-out set, overall and by number of digits."""
        right: dict[int, list[bool]] = {}
        for (a, b), ids in zip(self.arith.heldout, responses):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            right.setdefault(len(str(a)), []).append(Arith.check(str(a + b), text)[0] == 1.0)
        every = [x for values in right.values() for x in values]
        out = {"accuracy": float(np.mean(every)) if every else 0.0, "problems": float(len(every))}
        out.update({f"accuracy.digits_{d}": float(np.mean(v)) for d, v in sorted(right.items())})
        return out


def needs_tokenizer(config: Config) -> bool:
    """Whether the task speaks text (and so needs the model's tokenizer)."""
    return not isinstance(config.task, SimTask)


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of the model directory at `path`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def make_task(config: Config, tokenizer=None) -> Task:
    """The task the config names; tasks that speak text need the policy's
    tokenizer (see `needs_tokenizer`)."""
    match config.task:
        case SimTask() as cfg:
            return SimTaskImpl(cfg, config.run.seed)
        case ArithTask() as cfg:
            if tokenizer is None:
                raise ValueError("the arith task needs the model's tokenizer")
            return ArithTaskImpl(cfg, config.run.seed, tokenizer)
        case DatasetTask() as cfg:
            if tokenizer is None:
                raise ValueError("the dataset task needs the model's tokenizer")
            return DatasetTaskImpl(cfg, config.run.seed, tokenizer)
        case ReasoningGymTask() as cfg:
            if tokenizer is None:
                raise ValueError("the reasoning_gym task needs the model's tokenizer")
            return ReasoningGymTaskImpl(cfg, config.run.seed, tokenizer)
    raise ValueError(f"unknown task {config.task!r}")
