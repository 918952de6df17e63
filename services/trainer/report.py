"""What `rlflow report` says about the trainer (`RoleSpec.report`): the gap
between the engine that sampled each token and the trainer, and whether it
grows (a run that drifts apart from its engine: docs/training.md, the
corrections)."""

from __future__ import annotations

import math

from rlflow.control.stats import TREND_STEPS
from rlflow.rundir import StepRow

#: The gap grows when the p99 of its last steps is at least this times its first steps', and above
#: `GROWN_FLOOR` (a float32 rollout against a float32 trainer sits near 1e-6).
GROWS_BY = 2.0
GROWN_FLOOR = 0.05


def line(rows: list[StepRow], last: int = TREND_STEPS) -> str:
    """The gap's p99 and largest over the first and last `last` steps; named when it grows ("" without it)."""
    rows = [r for r in rows if math.isfinite(r.train.get("gap_p99", math.nan))]
    if not rows:
        return ""
    first, latest = rows[:last], rows[-last:]

    def mean(part: list[StepRow], key: str) -> float:
        return sum(r.train[key] for r in part) / len(part)

    before, now = mean(first, "gap_p99"), mean(latest, "gap_p99")
    largest = max(r.train["gap_max"] for r in rows)
    text = (f"engine-trainer gap |log p_train - log p_rollout| per token: p99 {before:.3g} over the first "
            f"{len(first)} steps, {now:.3g} over the last {len(latest)}; largest {largest:.3g}")
    masked = mean(latest, "masked_share") if all("masked_share" in r.train for r in latest) else 0.0
    if masked > 0:
        text += f"; {100 * masked:.1f}% of tokens masked lately"
    if len(rows) > last and now >= GROWS_BY * before and now > GROWN_FLOOR:
        text += (f". The gap grows ({now / before:.1f}x): the rollout and the trainer drift apart; "
                 "see the corrections in docs/training.md")
    return text
