"""Environments and tools for multi-turn episodes: the contract, the built-ins,
and the pool of worker processes that runs them, killably, under a timeout
per call.

An environment is a class named by import path; its `reset` gives an
episode's first observation of a dataset row, its `step` answers each model
turn with an observation, a reward and whether the episode is over::

    # guess.py: guess a number from 1 to 100; the dataset row holds it
    from rlflow.env import Step

    class Guess:
        def reset(self, row):
            return "Guess my number, from 1 to 100. "

        def step(self, episode, turn):
            said, secret = turn.strip(), episode.row["secret"]
            if not said.isdigit():
                return Step("Say a number. ", 0.0, False)
            if int(said) == secret:
                return Step(None, 1.0, True)
            return Step("Higher. " if int(said) < secret else "Lower. ", 0.0, False)

(examples/guess.py). A run names it in ``[roles.env] environment = {path =
"guess:Guess"}``. The
env role's replicas run it in worker processes on a pool of their own; the
rollout asks them for every step over the env channel (SPEC.md) and serves
other episodes meanwhile. Tools are functions named by import path,
shown to the model through the chat template and called when the model's
turn holds tool calls (see `core`). Built in:

* `rlflow.env.tools:python`: the model's program, run in the code sandbox;
* `rlflow.env.chat:Ask`: one question from the row, as a chat, over when
  the model answers without calling a tool;
* `rlflow.env.arith:SecondTry`: the default task's addition with a second
  try that starts from the columns marked right;
* `rlflow.env.sim:SimEnv`: simulated episodes and latencies (benches, tests).

Importing this package is cheap: the pool loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlflow.config.environment import EnvironmentSpec, ToolSpec, check_tools
from rlflow.env.core import EnvError, Episode, Step

_LAZY = {
    "open_env_pool": "rlflow.env.pool",
    "EnvPool": "rlflow.env.pool",
    "Outcome": "rlflow.env.pool",
    "EnvHandler": "rlflow.env.handler",
}

__all__ = ["EnvError", "EnvironmentSpec", "Episode", "Step", "ToolSpec", "check_tools", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
