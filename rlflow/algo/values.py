"""A learned value function's side of PPO: per-token rewards, GAE, the
clipped value loss, and the statistics that say how well the value model fits.

Indexing: a sample's response tokens are ``r_0 .. r_{T-1}``; ``V_t`` is the
value model's estimate of the state before ``r_t`` (the prompt and ``r_0 .. r_{t-1}``),
read at the position whose hidden state predicts ``r_t``, as the policy's
log-probability of ``r_t`` is. The episode ends after ``r_{T-1}`` (a response
cut at the length cap too: nothing follows it), so ``V_T = 0``.

Per-token rewards: the sample's reward at its last token, plus, where the run
puts a KL penalty into the reward (`kl_in = "reward"`), ``-kl_coef * KL_t`` at
every token. GAE (Schulman et al., 2016)::

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t                  (the value model's target)

``lam = 0`` gives the one-step TD error, ``lam = 1`` the discounted return
minus the value. In an episode with an environment, the observation tokens
(loss mask 0) are the environment's, not decisions of the policy: GAE runs
over the model's own tokens alone (the value after a turn's last token is
the value before the next turn's first), and an observation token gets
advantage 0 and its own value as its return (nothing to learn there).
Everything here but `value_loss` is numpy (the trainer reads the statistics
of the value columns without torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from rlflow.protocol import samples


def own_count(row: Any) -> int:
    """Response tokens of a sample that are the policy's: its loss mask's ones (every token
    without one; an episode's observations are the environment's)."""
    return len(row.response_ids) if row.loss_mask is None else int(row.loss_mask.sum())


def own_tokens(rows: list) -> np.ndarray:
    """bool [tokens]: which of the concatenated response tokens of `rows` are the policy's."""
    if not rows:
        return np.ones(0, bool)
    return np.concatenate([np.ones(len(r.response_ids), bool) if r.loss_mask is None else r.loss_mask.astype(bool)
                           for r in rows])


def token_rewards(reward: float, length: int, penalty: np.ndarray | None = None) -> np.ndarray:
    """float64 [length]: `reward` at the last token, minus `penalty` (per token, already scaled) at each."""
    out = np.zeros(length, np.float64) if penalty is None else -np.asarray(penalty, np.float64)
    if length:
        out[-1] += reward
    return out


def gae(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns) of one sample, float64 [T], from its per-token
    rewards and values (``V_T = 0``: the response ends the episode)."""
    rewards = np.asarray(rewards, np.float64)
    values = np.asarray(values, np.float64)
    if rewards.shape != values.shape:
        raise ValueError(f"{len(rewards)} rewards and {len(values)} values: one of each per token")
    advantages = np.zeros_like(values)
    running, following = 0.0, 0.0
    for t in range(len(values) - 1, -1, -1):
        delta = rewards[t] + gamma * following - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
        following = values[t]
    return advantages, advantages + values


def batch_gae(batch: Any, values: np.ndarray, gamma: float, lam: float,
              penalty: Callable[[Any], np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float32 [T] advantages and returns of every sample of `batch` (a
    `SampleBatch` with rewards) from `values` (float32 [T]); `penalty(row)`:
    a sample's per-token penalty, already scaled (None: none). Failed samples
    and those without a finite reward get NaN."""
    if batch.rewards is None:
        raise ValueError("a batch without rewards reached the advantage estimate: the reward role comes before it")
    failed = {f.index for f in batch.failures}
    advantages = np.full(batch.n_tokens, np.nan, np.float32)
    returns = np.full(batch.n_tokens, np.nan, np.float32)
    offsets = batch.response_offsets.numpy()
    for row in samples(batch):
        if row.row in failed or row.reward is None or not math.isfinite(row.reward):
            continue
        a, b = offsets[row.row], offsets[row.row + 1]
        rewards = token_rewards(row.reward, b - a, None if penalty is None else penalty(row))
        if row.loss_mask is None:
            advantages[a:b], returns[a:b] = gae(rewards, values[a:b], gamma, lam)
            continue
        own = np.flatnonzero(row.loss_mask) + a
        # The reward at the episode's last token is the last own token's: what follows it is not the policy's.
        rewards = rewards[row.loss_mask.astype(bool)]
        if len(rewards) and not row.loss_mask[-1]:
            rewards[-1] += row.reward
        advantages[a:b], returns[a:b] = 0.0, values[a:b]
        advantages[own], returns[own] = gae(rewards, values[own], gamma, lam)
    return advantages, returns


def whiten(x: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """`x` less its mean, over its standard deviation (unchanged in scale when that is 0)."""
    x = np.asarray(x, np.float64)
    if x.size == 0:
        return x
    centred = x - x.mean()
    std = centred.std()
    return centred / (std + eps) if std > 0 else centred


def centre_by_returns(advantages: np.ndarray, returns: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """`advantages` less their mean, over the standard deviation of `returns`
    (the same tokens'): the step's advantages in units of how much its
    outcomes vary. Unlike `whiten`, a value model that fits well leaves small
    advantages small (its residuals are not blown up to unit size), and a
    batch whose returns do not vary, with nothing to teach, gets 0."""
    advantages, returns = np.asarray(advantages, np.float64), np.asarray(returns, np.float64)
    if advantages.size == 0:
        return advantages
    spread = returns.std()
    return (advantages - advantages.mean()) / (spread + eps) if spread > 0 else np.zeros_like(advantages)


def explained_variance(values: np.ndarray, returns: np.ndarray) -> float:
    """``1 - Var(returns - values) / Var(returns)``: 1 is a perfect fit, 0 no
    better than a constant, below 0 worse (NaN: the returns do not vary)."""
    values, returns = np.asarray(values, np.float64), np.asarray(returns, np.float64)
    spread = returns.var() if returns.size else 0.0
    if spread == 0:
        return math.nan
    return float(1.0 - (returns - values).var() / spread)


def value_loss(new: Any, old: Any, returns: Any, clip: float) -> tuple[Any, Any]:
    """PPO's clipped value loss, summed over tokens (torch tensors, per token):
    ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``, so that a
    value does not move further than `clip` from the one the advantages were
    computed with (0: no clipping). Also the count of tokens where the
    clipped term was the larger."""
    import torch  # here: the rest of this module is read where torch is not needed

    plain = (new - returns) ** 2
    if clip <= 0:
        return 0.5 * plain.sum(), torch.zeros((), dtype=torch.long)
    # Only a value moved further than `clip` is clipped: elsewhere the clipped term is the plain one exactly
    # (old + (new - old) is not always new in floating point), so that ties count as unclipped.
    moved = new - old
    clipped = (torch.where(moved.abs() > clip, old + moved.clamp(-clip, clip), new) - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped).sum(), (clipped > plain).sum()
