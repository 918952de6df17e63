"""The invariants of a `SampleBatch` beyond its fields' types: its columns agree.

Run on every batch made or decoded (`SampleBatch.__post_init__`), so that a
consumer can index one without further checks.
"""

from __future__ import annotations

from typing import Any


#: Columns every batch has: name -> (dtype, dimensions).
_COLUMNS = {
    "prompt_ids": ("int32", 1),
    "prompt_offsets": ("int64", 1),
    "sample_index": ("int32", 1),
    "response_ids": ("int32", 1),
    "response_offsets": ("int64", 1),
    "logprobs": ("float32", 1),
    "versions": ("int32", 1),
    "finish_reason": ("uint8", 1),
    "stamps": ("float64", 2),
}


def validate(batch: Any) -> None:
    """Check that the columns of `batch` (a `SampleBatch`) agree with each other.

    The codec checks each tensor against its frame; this checks the batch's
    own invariants (offsets monotone and in range, lengths consistent), so
    that a consumer can index it without further checks. Raises ValueError.

    It runs on every batch made or received, so its messages are only
    formatted when a check fails.
    """
    for name, (dtype, ndim) in _COLUMNS.items():
        tensor = getattr(batch, name)
        if tensor.dtype != dtype:
            raise _disagree(f"{name} is {tensor.dtype}, expected {dtype}")
        if len(tensor.shape) != ndim:
            raise _disagree(f"{name} has shape {list(tensor.shape)}")
    n = batch.finish_reason.shape[0]
    g = len(batch.groups)
    t = batch.response_ids.shape[0]
    if sum(info.size for info in batch.groups) != n:
        raise _disagree("group sizes do not add up to the sample count")
    if batch.prompt_offsets.shape[0] != g + 1:
        raise _disagree(f"prompt_offsets has {batch.prompt_offsets.numel} entries for {g} groups")
    if batch.response_offsets.shape[0] != n + 1:
        raise _disagree(f"response_offsets has {batch.response_offsets.numel} entries for {n} samples")
    for name, total in (("prompt_offsets", batch.prompt_ids.shape[0]), ("response_offsets", t)):
        off = getattr(batch, name).numpy()
        if off[0] != 0 or off[-1] != total:
            raise _disagree(f"{name} must run from 0 to {total}")
        if len(off) > 1 and (off[1:] < off[:-1]).any():
            raise _disagree(f"{name} must not decrease")
    for name in ("logprobs", "versions"):
        if getattr(batch, name).shape[0] != t:
            raise _disagree(f"{name} has {getattr(batch, name).numel} entries for {t} tokens")
    for name in ("teacher_logprobs", "ref_logprobs", "values", "returns", "token_advantages"):
        tensor = getattr(batch, name)
        if tensor is not None and (tensor.numel != t or tensor.dtype != "float32"):
            raise _disagree(f"{name} must be float32 [{t}]")
    ids, lps = batch.teacher_topk_ids, batch.teacher_topk_logprobs
    if (ids is None) != (lps is None):
        raise _disagree("teacher_topk_ids and teacher_topk_logprobs come together")
    if ids is not None:
        if ids.dtype != "int32" or len(ids.shape) != 2 or ids.shape[0] != t:
            raise _disagree(f"teacher_topk_ids must be int32 [{t}, k]")
        if lps.dtype != "float32" or lps.shape != ids.shape:
            raise _disagree(f"teacher_topk_logprobs must be float32 {list(ids.shape)}")
    if batch.sample_index.shape[0] != n:
        raise _disagree("per-sample columns must have n entries")
    if batch.stamps.shape[0] != n:
        raise _disagree("stamps must have one row per sample")
    if batch.rewards is not None and (batch.rewards.numel != n or batch.rewards.dtype != "float32"):
        raise _disagree(f"rewards must be float32 [{n}]")
    if batch.advantages is not None and (batch.advantages.numel != n or batch.advantages.dtype != "float32"):
        raise _disagree(f"advantages must be float32 [{n}]")
    mask = batch.loss_mask
    if mask is not None and (mask.numel != t or mask.dtype != "uint8" or len(mask.shape) != 1):
        raise _disagree(f"loss_mask must be uint8 [{t}]")
    env = batch.env_rewards
    if env is not None and (env.dtype != "float32" or len(env.shape) != 2 or env.shape[0] != n):
        raise _disagree(f"env_rewards must be float32 [{n}, K]")
    if batch.critic_versions is not None and (batch.critic_versions.numel != n
                                              or batch.critic_versions.dtype != "int32"):
        raise _disagree(f"critic_versions must be int32 [{n}]")
    _check_text(batch, "response_text", n)
    _check_text(batch, "prompt_text", g)
    for key, tensor in batch.reward_details.items():
        if tensor.numel != n:
            raise _disagree(f"reward_details[{key!r}] must have {n} entries")
    if any(f.index >= n for f in batch.failures):
        raise _disagree("a failure names a row past the end")


def _check_text(batch: Any, name: str, rows: int) -> None:
    """A text column (`name`, uint8 UTF-8 bytes) and its offsets (`name`_offsets, int64 [rows + 1]) come
    together, the offsets run from 0 to the bytes' length without decreasing, and each row's bytes are
    valid UTF-8: the whole column is, and no row starts inside a character (on a continuation byte)."""
    data, offsets = getattr(batch, name), getattr(batch, f"{name}_offsets")
    if data is None and offsets is None:
        return
    if data is None or offsets is None:
        raise _disagree(f"{name} and {name}_offsets come together")
    if data.dtype != "uint8" or len(data.shape) != 1:
        raise _disagree(f"{name} must be uint8 [B]")
    if offsets.dtype != "int64" or len(offsets.shape) != 1 or offsets.shape[0] != rows + 1:
        raise _disagree(f"{name}_offsets must be int64 [{rows + 1}]")
    off, buf = offsets.numpy(), data.numpy()
    if off[0] != 0 or off[-1] != len(buf):
        raise _disagree(f"{name}_offsets must run from 0 to {len(buf)}")
    if len(off) > 1 and (off[1:] < off[:-1]).any():
        raise _disagree(f"{name}_offsets must not decrease")
    starts = off[:-1][off[:-1] < len(buf)]
    if ((buf[starts] & 0xC0) == 0x80).any():
        raise _disagree(f"a row of {name} starts inside a UTF-8 character")
    try:
        str(memoryview(buf), "utf-8")
    except UnicodeDecodeError as exc:
        raise _disagree(f"{name} is not UTF-8 at byte {exc.start}") from None


def _disagree(what: str) -> ValueError:
    return ValueError(f"columns disagree: {what}")
