"""The gap between the engine that sampled a token and the trainer that
learns from it, per step: what the mismatch corrections act on.

Per token, |log p_train - log p_behaviour| (the trainer's log-probability of
the sampled token at the step's start against the engine's): its mean, its
99th percentile and its largest; per sample, the sequence-level weight (the
geometric mean of its token weights p_train / p_behaviour): its least and
its largest. A stale sample's gap holds its staleness too.

The percentile comes from a histogram of 0.05-decade bins (to within 12%),
so that the ranks of a step add theirs up without gathering every token.
"""

from __future__ import annotations

import math

import torch

from rlflow.algo.losses import sample_mean

#: Upper edges of the histogram's bins, 1e-8 to 1e2; one more bin takes what lies above.
EDGES = torch.logspace(-8, 2, 201, dtype=torch.float64)


class Gap:
    """A step's gap, added to pass by pass (`add`), then summed over ranks (`stats`)."""

    def __init__(self) -> None:
        self.counts = torch.zeros(len(EDGES) + 1, dtype=torch.float64)
        self.total = 0.0
        self.largest = 0.0
        self.seq_low = math.inf
        self.seq_high = -math.inf

    def add(self, train: torch.Tensor, behaviour: torch.Tensor, sample: torch.Tensor) -> None:
        """One pass's tokens: log-probabilities under each, and each token's sample."""
        if not len(train):
            return
        diff = (train.detach() - behaviour.detach()).double().cpu()
        gap = diff.abs()
        self.counts += torch.bincount(torch.bucketize(gap, EDGES), minlength=len(EDGES) + 1).double()
        self.total += float(gap.sum())
        self.largest = max(self.largest, float(gap.max()))
        log_seq = sample_mean(diff, sample.cpu())  # per token, its sample's: the extremes are the same
        self.seq_low = min(self.seq_low, float(log_seq.min()))
        self.seq_high = max(self.seq_high, float(log_seq.max()))

    def stats(self, ranks) -> dict[str, float]:
        """The step's figures over every rank (a collective: every rank calls it)."""
        counts = torch.tensor(ranks.sum(self.counts.tolist()), dtype=torch.float64)
        (total,) = ranks.sum([self.total])
        largest, neg_low, high = ranks.highest([self.largest, -self.seq_low, self.seq_high])
        tokens = float(counts.sum())
        if tokens == 0:
            return {}
        above = int(torch.searchsorted(counts.cumsum(0), 0.99 * tokens))
        p99 = min(float(EDGES[above]) if above < len(EDGES) else largest, largest)
        return {
            "gap_mean": total / tokens,
            "gap_p99": p99,
            "gap_max": largest,
            "seq_weight_min": math.exp(-neg_low),
            "seq_weight_max": math.exp(high),
        }
