"""A step's samples as the torch trainer's passes take them: packed into
right-padded rows, their per-token columns concatenated, and the loss mask
(a run with an environment: observations are not trained on)."""

from __future__ import annotations

import numpy as np
import torch

from rlflow.algo.values import own_count, own_tokens

#: Right-padded ids and mask, the response tokens, and where their predictions sit in the logits (rows, columns).
Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def pack(part: list) -> Packed:
    """Right-padded ids and mask, the response tokens, and where their
    predictions sit in the logits."""
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in part)
    ids = torch.zeros((len(part), width), dtype=torch.long)
    mask = torch.zeros((len(part), width), dtype=torch.long)
    rows_idx, cols_idx, targets = [], [], []
    for row, sample in enumerate(part):
        seq = np.concatenate([sample.prompt_ids, sample.response_ids])
        ids[row, : len(seq)] = torch.from_numpy(seq.astype(np.int64))
        mask[row, : len(seq)] = 1
        start = len(sample.prompt_ids)
        positions = torch.arange(start - 1, start - 1 + len(sample.response_ids))
        rows_idx.append(torch.full_like(positions, row))
        cols_idx.append(positions)
        targets.append(torch.from_numpy(sample.response_ids.astype(np.int64)))
    return ids, mask, torch.cat(targets), (torch.cat(rows_idx), torch.cat(cols_idx))


def column(part: list, name: str, keep: torch.Tensor | None = None) -> torch.Tensor:
    """A per-token column of the samples `part`, concatenated (float32, or int32 ids); only the
    tokens `keep` says are trained on, if given."""
    # One copy, in numpy: writable, whatever the rows' arrays are (a received batch's are read-only).
    values = torch.from_numpy(np.concatenate([getattr(r, name) for r in part]))
    return values if keep is None else values[keep]


def loss_mask(part: list) -> torch.Tensor | None:
    """Which tokens of `part`'s responses, concatenated, are trained on (None: all of them)."""
    if all(r.loss_mask is None for r in part):
        return None
    return torch.from_numpy(own_tokens(part))


def own(sample, values):
    """A per-token quantity of `sample` (numpy or torch) at the tokens it is trained on."""
    if sample.loss_mask is None:
        return values
    keep = sample.loss_mask.astype(bool)
    return values[keep] if isinstance(values, np.ndarray) else values[torch.from_numpy(keep)]


def token_mean(rows: list, per_sample) -> float:
    """The mean over every token trained on of the batch of a per-token quantity."""
    values = [own(r, per_sample(r)) for r in rows if own_count(r)]
    return float(np.concatenate(values).mean()) if values else 0.0
