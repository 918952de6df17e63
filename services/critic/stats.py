"""The trainer step's statistics of the critic's columns (`RoleSpec.batch_stats`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rlflow.algo.values import explained_variance


def of_batch(batch: Any, step: int) -> dict[str, float]:
    """How the critic's columns of a trainer step's `batch` (a `SampleBatch`)
    fit, and how stale they are at actor step `step` (empty: no critic columns;
    the trainer adds these to its step's metrics through `RoleSpec.batch_stats`).

    ``critic_value_loss``: half the mean squared error of the values against
    the returns, over every token: the critic's loss on these samples before
    it trained on them. ``critic_explained_var``: `explained_variance` of the
    same. ``critic_staleness_*``: `step` minus the critic version that
    computed each sample's values.
    """
    if batch.values is None or batch.returns is None or batch.n_tokens == 0:
        return {}
    values, returns = batch.values.numpy(), batch.returns.numpy()
    ok = np.isfinite(values) & np.isfinite(returns)
    out = {
        "critic_value_loss": float(0.5 * np.mean((values[ok] - returns[ok]) ** 2)) if ok.any() else math.nan,
        "critic_explained_var": explained_variance(values[ok], returns[ok]),
    }
    if batch.critic_versions is not None and batch.n_samples:
        behind = step - batch.critic_versions.numpy().astype(np.int64)
        out.update(critic_staleness_mean=float(behind.mean()), critic_staleness_max=float(behind.max()),
                   critic_version=float(batch.critic_versions.numpy().max()))
    return out
