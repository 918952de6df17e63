"""`reasoning_gym`: the verifier of the reasoning-gym dataset a problem came
from, asked about a response (the `reasoning_gym` task's rows are the
package's own entries: question, answer and metadata)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from rlflow.rewards.core import Sample


def reasoning_gym(sample: Sample) -> float:
    """The dataset's own score of the response (the answer it extracts is its business)."""
    metadata = sample.row.get("metadata") or {}
    source = metadata.get("source_dataset")
    if not source:
        raise ValueError("the row is not a reasoning-gym entry (no metadata.source_dataset)")
    return float(_score_fn(source)(sample.response, dict(sample.row)))


@functools.cache
def _score_fn(source: str) -> Callable[[str, dict], float]:
    """The dataset's scorer, made once per worker: the package makes it by generating a dataset of its
    default size (26 ms for spell_backward, against 0.5 us a call for the scorer), which, made for each
    sample, held a run's reward role at 94% busy and the trainer starved 73% on a 2-core CPU."""
    import reasoning_gym as gym

    return gym.get_score_answer_fn(source)
