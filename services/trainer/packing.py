"""A step's samples as the torch trainer's passes take them: packed into
right-padded rows, their per-token columns concatenated, and the loss mask
(a run with an environment: observations are not trained on).

A group's samples share their prompt: packed as one row (`prompt_units`),
the prompt goes through the model once, then each response, every response
attending to the prompt and to its own tokens alone (a block mask, the
positions of each response counted on from the prompt's end). The
log-probabilities, and so the loss and its gradient, are those of a row per
sample; the tokens through the model are the prompt once where they were
the prompt once a sample (GRPO's 8 or 16 samples of a prompt: several times
fewer where prompts are long and answers short). A longer row costs more
attention, which a block mask does not save (the kernels compute the whole
square): a response joins its prompt's row only where that costs less than
a row of its own (`row_cost`, by the model's shape: `attention_weight`), so
long answers to a short prompt keep a row each. Only under sdpa attention
without sliding windows (`can_share`): eager attention adds a mask where
sdpa selects by it, flash attention takes no block mask, and a window would
have to be drawn into the mask."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from rlflow.algo.values import own_count, own_tokens


class Packed(NamedTuple):
    """A pass's inputs, and where the predictions of its response tokens sit in the logits."""

    ids: torch.Tensor
    """[rows, width] token ids, right-padded."""
    mask: torch.Tensor
    """[rows, width] 1 for a token, 0 for padding; with shared prompts a [rows, 1, width, width]
    boolean block mask (which token each token attends to)."""
    positions: torch.Tensor | None
    """[rows, width] each token's position (shared prompts; None: counted from each row's start)."""
    targets: torch.Tensor
    """The response tokens, sample after sample in the order of the part packed."""
    where: tuple[torch.Tensor, torch.Tensor]
    """The row and column of each target's prediction."""


def can_share(config) -> bool:
    """Whether a model of this (Hugging Face) config takes the block mask of shared prompts as meant:
    sdpa attention, no sliding window."""
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ()) or (
        getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None))
    return getattr(config, "_attn_implementation", None) == "sdpa" and not sliding


def attention_weight(config) -> float:
    """What attention costs a token per token of its row, over what its linear layers cost (FLOPs of
    a layer: the projections with their key-value heads, a gated MLP, the output layer's share)."""
    d, heads = config.hidden_size, config.num_attention_heads
    head = getattr(config, "head_dim", None) or d // heads
    queries, keys = heads * head, getattr(config, "num_key_value_heads", None) or heads
    ffn = getattr(config, "intermediate_size", None) or 4 * d
    linear = 2 * (2 * d * queries + 2 * d * keys * head + 3 * d * ffn) + 2 * d * config.vocab_size / max(
        1, config.num_hidden_layers)
    return 4 * queries / linear


def row_cost(width: int, weight: float) -> float:
    """A row of `width` tokens in units of one token's linear layers: each token also attends over the
    whole row (the kernels compute the square, masked or not), `weight` (`attention_weight`) a token."""
    return width * (1 + weight * width)


def prompt_units(part: list, budget: int, weight: float) -> list[list[int]]:
    """Indices of `part`, the samples with one prompt together (in the order first seen), each unit
    at most `budget` tokens with its prompt counted once (a sample longer alone is a unit alone); a
    sample joins a unit only where that costs less than a row of its own (`row_cost`)."""
    by_prompt: dict[bytes, list[int]] = {}
    for i, sample in enumerate(part):
        by_prompt.setdefault(np.asarray(sample.prompt_ids, np.int64).tobytes(), []).append(i)
    units: list[list[int]] = []
    for same in by_prompt.values():
        prompt = len(part[same[0]].prompt_ids)
        unit: list[int] = []
        width = prompt
        for i in same:
            n = len(part[i].response_ids)
            joined = row_cost(width + n, weight) - row_cost(width, weight)
            if unit and (width + n > budget or joined > row_cost(prompt + n, weight)):
                units.append(unit)
                unit, width = [], prompt
            unit.append(i)
            width += n
        units.append(unit)
    return units


def unit_width(part: list, unit: list[int]) -> int:
    """The tokens of `unit`'s row: its prompt once and every response."""
    return len(part[unit[0]].prompt_ids) + sum(len(part[i].response_ids) for i in unit)


def pack(part: list, units: list[list[int]] | None = None) -> Packed:
    """`part` packed a row per unit of `units` (samples sharing their prompt, see `prompt_units`;
    None: a row per sample)."""
    units = units if units is not None else [[i] for i in range(len(part))]
    shared = any(len(u) > 1 for u in units)
    width = max(unit_width(part, u) for u in units)
    ids = torch.zeros((len(units), width), dtype=torch.long)
    positions = torch.zeros((len(units), width), dtype=torch.long)
    mask = torch.zeros((len(units), 1, width, width) if shared else (len(units), width),
                       dtype=torch.bool if shared else torch.long)
    rows_idx: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * len(part)
    cols_idx: list[torch.Tensor] = list(rows_idx)
    for row, unit in enumerate(units):
        prompt = torch.from_numpy(np.asarray(part[unit[0]].prompt_ids, np.int64))
        n_prompt = len(prompt)
        ids[row, :n_prompt] = prompt
        positions[row, :n_prompt] = torch.arange(n_prompt)
        if shared:
            mask[row, 0, :n_prompt, :n_prompt] = torch.ones(n_prompt, n_prompt, dtype=torch.bool).tril()
        start = n_prompt
        for i in unit:
            response = torch.from_numpy(np.asarray(part[i].response_ids, np.int64))
            n = len(response)
            end = start + n
            ids[row, start:end] = response
            positions[row, start:end] = torch.arange(n_prompt, n_prompt + n)
            if shared:
                mask[row, 0, start:end, :n_prompt] = True
                mask[row, 0, start:end, start:end] = torch.ones(n, n, dtype=torch.bool).tril()
            else:
                mask[row, :end] = 1
            # The first token is predicted at the prompt's last, each next one at the token before it.
            cols = torch.arange(start - 1, end - 1)
            if n:
                cols[0] = n_prompt - 1
            rows_idx[i], cols_idx[i] = torch.full_like(cols, row), cols
            start = end
        if shared:  # padding attends to itself alone (a row of nothing would be NaN)
            pad = torch.arange(start, width)
            mask[row, 0, pad, pad] = True
    targets = [torch.from_numpy(np.asarray(s.response_ids, np.int64)) for s in part]
    return Packed(ids, mask, positions if shared else None, torch.cat(targets),
                  (torch.cat(rows_idx), torch.cat(cols_idx)))


def logits_at(model: torch.nn.Module, packed: Packed, device: torch.device) -> torch.Tensor:
    """The model's logits at the predictions of `packed`'s targets, [targets, vocabulary]."""
    rows, cols = packed.where
    kwargs = {} if packed.positions is None else {"position_ids": packed.positions.to(device)}
    out = model(input_ids=packed.ids.to(device), attention_mask=packed.mask.to(device), **kwargs)
    return out.logits[rows.to(device), cols.to(device)]


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
