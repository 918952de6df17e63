"""How one optimizer step's samples are split: between trainer ranks, and
into micro-batches within a rank.

Trainer ranks run in lock step (every forward and backward pass of a
sharded model gathers and scatters with every rank), so a step takes as
long as its slowest rank. `deal` gives each rank about the same number of
tokens: longest sample first, each to the rank with the fewest tokens so
far (LPT). No two ranks then differ by more than the longest sample, and
with a long tail the longest samples are spread one per rank before any
rank gets a second; each rank's share has about the same spread of
lengths, so its micro-batches (`micro_batches`) come out alike in number
and size, pass by pass.
"""

from __future__ import annotations

from collections.abc import Sequence


def deal(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of `lengths` for each of `ranks`, each list ascending, so that
    the ranks' token sums differ by at most ``max(lengths)``. Deterministic."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    if ranks == 1:
        return [list(range(len(lengths)))]
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(share) for share in shares]


def micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped by length (shortest first), each group
    padded to its longest at most `budget` tokens (a sample longer than the
    budget is a micro-batch alone)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        length = lengths[i]
        if current and max(longest, length) * (len(current) + 1) > budget:
            out.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        out.append(current)
    return out
