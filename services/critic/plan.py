"""What `rlflow plan` needs of the critic (`RoleSpec.plan`): its costs in a run."""

from __future__ import annotations

import json
from typing import Any

from rlflow.rundir import RunDir


def costs(folder: RunDir, config: Any, devices: int) -> dict[str, float]:
    """The critic's measured forward and step seconds per token on one device (its rank 0 counts them; its
    ranks work in lock step, on `devices`), and the steps it may owe: `rlflow.tools.plan.Learner`'s fields."""
    counters: dict[str, float] = {}
    for file in sorted(folder.traces.glob("critic-*.json")):
        for key, value in json.loads(file.read_text()).get("counters", {}).items():
            counters[key] = counters.get(key, 0.0) + value
    if not counters.get("tokens") or not counters.get("critic_tokens"):
        raise ValueError(f"{folder.path} has a critic but no record of its work (trace/critic-0.json)")
    return {"forward_s_per_token": counters.get("value_s", 0.0) / counters["tokens"] * devices,
            "step_s_per_token": counters.get("critic_step_s", 0.0) / counters["critic_tokens"] * devices,
            "max_steps_owed": config.roles.critic.max_steps_owed}
