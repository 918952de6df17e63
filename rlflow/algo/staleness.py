"""The strict staleness rule, in one place.

With ``run.staleness_check = "strict"`` no token may be trained on by a
trainer more than ``max_staleness`` versions ahead of the policy that
generated it. A group is judged by its oldest token: the version it started
on (a group is generated from one start; later tokens can only be newer).
The simulated engine, the vLLM engine and the trainer all ask this function.
"""

from __future__ import annotations


def too_stale(started_on: int, version: int, max_staleness: int) -> bool:
    """Whether a group whose oldest token is from policy `started_on` is past
    the bound for weights (or a trainer) at `version`: it could only be
    trained on by a trainer at `version` or later, more than `max_staleness`
    versions after it started."""
    return version - started_on > max_staleness
