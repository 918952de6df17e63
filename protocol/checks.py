"""The invariants of a `SampleBatch` beyond its fields' types: its columns agree.

Run on every batch made or decoded (`SampleBatch.__post_init__`), so that a
consumer can index one without further checks.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def validate(batch: Any) -> None:
    """Check that the columns of `batch` (a `SampleBatch`) agree with each other.

    The codec checks each tensor against its frame; this checks the batch's
    own invariants (offsets monotone and in range, lengths consistent), so
    that a consumer can index it without further checks. Raises ValueError.
    """
    n = batch.n_samples
    g = len(batch.groups)
    t = batch.response_ids.numel

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"columns disagree: {what}")

    for name, dtype in (
        ("prompt_ids", "int32"),
        ("prompt_offsets", "int64"),
        ("sample_index", "int32"),
        ("response_ids", "int32"),
        ("response_offsets", "int64"),
        ("logprobs", "float32"),
        ("versions", "int32"),
        ("finish_reason", "uint8"),
        ("stamps", "float64"),
    ):
        tensor = getattr(batch, name)
        need(tensor.dtype == dtype, f"{name} is {tensor.dtype}, expected {dtype}")
        need(len(tensor.shape) == (2 if name == "stamps" else 1), f"{name} has shape {list(tensor.shape)}")
    need(sum(info.size for info in batch.groups) == n, "group sizes do not add up to the sample count")
    need(batch.prompt_offsets.numel == g + 1, f"prompt_offsets has {batch.prompt_offsets.numel} entries for {g} groups")
    need(batch.response_offsets.numel == n + 1, f"response_offsets has {batch.response_offsets.numel} entries for {n} samples")
    for name, off, total in (
        ("prompt_offsets", batch.prompt_offsets.numpy(), batch.prompt_ids.numel),
        ("response_offsets", batch.response_offsets.numpy(), t),
    ):
        need(off[0] == 0 and off[-1] == total, f"{name} must run from 0 to {total}")
        need(bool(np.all(np.diff(off) >= 0)), f"{name} must not decrease")
    for name in ("logprobs", "versions"):
        need(getattr(batch, name).numel == t, f"{name} has {getattr(batch, name).numel} entries for {t} tokens")
    for name in ("teacher_logprobs", "ref_logprobs"):
        tensor = getattr(batch, name)
        need(tensor is None or (tensor.numel == t and tensor.dtype == "float32"), f"{name} must be float32 [{t}]")
    ids, lps = batch.teacher_topk_ids, batch.teacher_topk_logprobs
    need((ids is None) == (lps is None), "teacher_topk_ids and teacher_topk_logprobs come together")
    if ids is not None:
        need(ids.dtype == "int32" and len(ids.shape) == 2 and ids.shape[0] == t, f"teacher_topk_ids must be int32 [{t}, k]")
        need(lps.dtype == "float32" and lps.shape == ids.shape, f"teacher_topk_logprobs must be float32 {list(ids.shape)}")
    need(batch.finish_reason.numel == n and batch.sample_index.numel == n, "per-sample columns must have n entries")
    need(batch.stamps.shape[0] == n, "stamps must have one row per sample")
    if batch.rewards is not None:
        need(batch.rewards.numel == n and batch.rewards.dtype == "float32", f"rewards must be float32 [{n}]")
    if batch.advantages is not None:
        need(batch.advantages.numel == n and batch.advantages.dtype == "float32", f"advantages must be float32 [{n}]")
    for key, tensor in batch.reward_details.items():
        need(tensor.numel == n, f"reward_details[{key!r}] must have {n} entries")
    need(all(f.index < n for f in batch.failures), "a failure names a row past the end")
