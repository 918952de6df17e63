"""`Ask`: one question from the dataset row, as a chat; the episode ends at the
first turn that calls no tool. What the model answered is left to the
run's reward functions (they see every turn). The environment of a run
whose point is its tools."""

from __future__ import annotations

from typing import Any

from rlflow.env.core import Episode, Step


class Ask:
    """The row's `prompt` column as the user's message (after `system`, if given)."""

    def __init__(self, *, prompt: str = "prompt", system: str = ""):
        self.prompt, self.system = prompt, system

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        question = row[self.prompt]
        messages = list(question) if isinstance(question, list) else [{"role": "user", "content": str(question)}]
        return ([{"role": "system", "content": self.system}] if self.system else []) + messages

    def step(self, episode: Episode, turn: str) -> Step:
        return Step(None, 0.0, True)
