"""Environments and tools for the tests, imported by env workers (this folder is
on their import path, as on the tests')."""

from __future__ import annotations

import asyncio
import os
import time

from rlflow.env import Step


class Count:
    """Say the turn's number back; done at `turns`, with reward `turn / 10` at each turn."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    def reset(self, row):
        return f"count:{row.get('start', 0)}"

    def step(self, episode, turn):
        episode.state["seen"] = episode.state.get("seen", 0) + 1
        done = episode.turn >= self.turns
        return Step(None if done else f"<{episode.turn}:{episode.state['seen']}>", episode.turn / 10, done)

    def reference_turns(self, row):
        return ["one", "two", "three"]


class Chat:
    """Chat messages, to be rendered by the template."""

    def reset(self, row):
        return [{"role": "user", "content": "hi"}]

    def step(self, episode, turn):
        return Step([{"role": "user", "content": f"again {episode.turn}"}], 0.0, episode.turn >= 2)


class Failing:
    """Its step raises at turn 2."""

    def reset(self, row):
        return "go"

    def step(self, episode, turn):
        if episode.turn == 2:
            raise RuntimeError("the environment broke")
        return Step("more", 0.0, False)


class ScriptedFailing(Failing):
    """`Failing`, with scripted turns for `rlflow check`."""

    def reference_turns(self, row):
        return ["a", "b"]


class BadReturn:
    """Its step returns what a step may not."""

    def reset(self, row):
        return "go"

    def step(self, episode, turn):
        return "not a step"


class Slow:
    """Async steps that take `wait_s`."""

    def __init__(self, wait_s: float = 0.2):
        self.wait_s = wait_s

    def reset(self, row):
        return "go"

    async def step(self, episode, turn):
        await asyncio.sleep(self.wait_s)
        return Step(None, 1.0, True)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def stall(seconds: float) -> str:
    """Sleep, blocking the worker.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


async def nap(seconds: float) -> str:
    """Sleep without blocking the worker.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke"


def die() -> str:
    """End the worker process at once."""
    os._exit(3)


def pid() -> int:
    """The worker's process id."""
    return os.getpid()
