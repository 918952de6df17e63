"""The strict staleness rule, and how many groups a rollout replica holds, in one place.

With ``run.staleness_check = "strict"`` no token may be trained on by a
trainer more than ``max_staleness`` versions ahead of the policy that
generated it. A group is judged by its oldest token: the version it started
on (a group is generated from one start; later tokens can only be newer).
The simulated engine, the vLLM engine and the trainer all ask this function.
"""

from __future__ import annotations

import math

#: A rollout replica holds up to this many times the groups that fill its slots: a group keeps its
#: place until its last sample finishes, so with a long tail a replica needs several times the groups
#: its slots hold; the staleness bound caps the total.
HOLD = 16


def too_stale(started_on: int, version: int, max_staleness: int) -> bool:
    """Whether a group whose oldest token is from policy `started_on` is past
    the bound for weights (or a trainer) at `version`: it could only be
    trained on by a trainer at `version` or later, more than `max_staleness`
    versions after it started."""
    return version - started_on > max_staleness


def groups_held(slots: int, samples_per_prompt: int) -> int:
    """The most groups the controller lets one rollout replica hold at once (generating, or done and
    not yet acknowledged): `slots`, the sequences it decodes at once (0: one group's)."""
    return max(1, math.ceil(HOLD * (slots or samples_per_prompt) / samples_per_prompt))
