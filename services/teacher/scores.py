"""What a teacher engine finds for a batch, and the probe every replica scores."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: The sequence every replica scores at start (its first `PROBE_PROMPT`
#: tokens the prompt); the controller refuses replicas that disagree on it.
PROBE_IDS = list(range(3, 19))
PROBE_PROMPT = 4


@dataclass
class Scores:
    """What an engine found for one batch (token columns in the batch's order)."""

    logprobs: np.ndarray
    """float32 [T]: the sampled tokens' log-probabilities (NaN where a sample failed)."""
    topk_ids: np.ndarray | None = None
    """int32 [T, k]."""
    topk_logprobs: np.ndarray | None = None
    """float32 [T, k]."""
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Row -> (kind, message) of each sample it could not score."""
