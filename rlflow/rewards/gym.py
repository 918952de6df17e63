"""`reasoning_gym`: the verifier of the reasoning-gym dataset a problem came
from, asked about a response (the `reasoning_gym` task's rows are the
package's own entries: question, answer and metadata)."""

from __future__ import annotations

from rlflow.rewards.core import Sample


def reasoning_gym(sample: Sample) -> float:
    """The dataset's own score of the response (the answer it extracts is its business)."""
    import reasoning_gym as gym

    metadata = sample.row.get("metadata") or {}
    source = metadata.get("source_dataset")
    if not source:
        raise ValueError("the row is not a reasoning-gym entry (no metadata.source_dataset)")
    return float(gym.get_score_answer_fn(source)(sample.response, dict(sample.row)))
