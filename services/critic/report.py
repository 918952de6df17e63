"""What `rlflow report` says about the critic (`RoleSpec.report`): how it fits."""

from __future__ import annotations

import math

from rlflow.control.stats import TREND_STEPS
from rlflow.rundir import StepRow


def line(rows: list[StepRow], last: int = TREND_STEPS) -> str:
    """How the critic fits over the last `last` steps, and how stale its values were ("" without a critic)."""
    rows = [r for r in rows if "critic_value_loss" in r.train][-last:]
    if not rows:
        return ""

    def mean(key: str) -> float:
        values = [r.train[key] for r in rows if math.isfinite(r.train.get(key, math.nan))]
        return sum(values) / len(values) if values else math.nan

    stale = max((r.train.get("critic_staleness_max", 0.0) for r in rows), default=0.0)
    return (f"critic over the last {len(rows)} steps: value loss {mean('critic_value_loss'):.4f}, explained "
            f"variance {mean('critic_explained_var'):.2f}; its values lagged the actor's step by "
            f"{mean('critic_staleness_mean'):.2f} versions on average, {stale:g} at most")
