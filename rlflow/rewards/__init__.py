"""Reward functions: the contract, the built-ins, and the pool of worker
processes that runs them, killably, under a timeout per call.

A reward function is named by import path, ``package.module:function``,
sync or async. It gets one `Sample` (prompt, response text and token ids,
reference answer, dataset row) and the keyword arguments of its
`FunctionSpec`, and returns a float, or a float and a dict of named parts::

    # my_rewards.py
    from rlflow.rewards import Sample

    def brevity(sample: Sample, *, limit: int = 200) -> tuple[float, dict[str, float]]:
        over = max(0, len(sample.response_ids) - limit)
        return 1.0 / (1 + over / limit), {"over_tokens": float(over)}

    async def judge(sample: Sample) -> float:  # async works too
        return float("because" in sample.response)

A run has several functions, each with a weight; a sample's reward is the
weighted sum and each function's value and parts are logged (`combine`).
Every result carries its function's name and a `Status` (ok, timeout,
error, crashed): a function that hangs, crashes or returns NaN fails that
sample visibly, never as a 0. See `core` for the optional attributes
(``batched``, ``prepare``, ``reference_response``).

Built in, by the same mechanism (``rlflow.rewards:math`` ...):

* `math`: the answer, extracted (``extract`` = boxed, last_number, marker,
  none), compared with the reference by math-verify;
* `exact` and `regex`: string equality, and a format check;
* `code`: the response's program run in the sandbox against the row's
  tests; the share passed;
* `reward_model`: a local Hugging Face sequence-classification model, in
  batches;
* `reasoning_gym`: the verifier of the reasoning-gym dataset a problem (a
  row of the `reasoning_gym` task) came from.

`rlflow.sandbox` is the code sandbox. Importing this package is
cheap: the built-ins and the pool load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlflow.rewards.core import (
    Combined,
    FunctionSpec,
    RewardFunctionError,
    Sample,
    Scored,
    Status,
    check_specs,
    combine,
    load_function,
)

#: Names served on first use, and the module each lives in.
_LAZY = {
    "math": "rlflow.rewards.text",
    "exact": "rlflow.rewards.text",
    "regex": "rlflow.rewards.text",
    "code": "rlflow.rewards.programs",
    "sandbox_problem": "rlflow.rewards.programs",
    "reward_model": "rlflow.rewards.model",
    "reasoning_gym": "rlflow.rewards.gym",
    "open_pool": "rlflow.rewards.pool",
    "RewardPool": "rlflow.rewards.pool",
    "FunctionInfo": "rlflow.rewards.pool",
    "PoolError": "rlflow.workers",
    "check_references": "rlflow.rewards.pool",
}

__all__ = [
    "Combined",
    "FunctionSpec",
    "RewardFunctionError",
    "Sample",
    "Scored",
    "Status",
    "check_specs",
    "combine",
    "load_function",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
