"""Drawing from the configured distributions (response lengths, latencies)."""

from __future__ import annotations

import numpy as np

from rlflow.config import Distribution, Fixed, LogNormal, Pareto


def draw(dist: Distribution, rng: np.random.Generator, size: int | None = None) -> np.ndarray | float:
    """Values of `dist` (a float if `size` is None)."""
    n = 1 if size is None else size
    match dist:
        case Fixed(value=value):
            out = np.full(n, value, dtype=float)
        case LogNormal(median=median, sigma=sigma, min=lo, max=hi):
            out = np.clip(median * np.exp(sigma * rng.standard_normal(n)), lo, hi)
        case Pareto(scale=scale, alpha=alpha, max=hi):
            out = np.minimum(scale * (1.0 + rng.pareto(alpha, n)), hi)
        case _:
            raise TypeError(f"not a distribution: {dist!r}")
    return float(out[0]) if size is None else out


def draw_lengths(dist: Distribution, rng: np.random.Generator, size: int) -> np.ndarray:
    """Token counts (at least 1) drawn from `dist`."""
    values = draw(dist, rng, size)
    return np.maximum(1, np.rint(values)).astype(np.int64)

