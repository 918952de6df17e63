"""Advantage estimators and the policy loss, with off-policy corrections.

The loss is PPO's clipped surrogate, aggregated over tokens (every response
token of the batch weighs the same). Three policies appear in it:

* the behaviour policy, which generated each token (log-probabilities come
  with the sample from the rollout, possibly several versions old);
* the proximal policy, the trainer's weights at the start of this update;
* the current policy, being optimized.

Decoupled (Hilton et al., 2022; AReaL): the ratio is current / proximal and
is clipped, while the gap between proximal and behaviour is corrected by an
importance weight proximal / behaviour. So the trust region is measured from
weights the trainer knows, and stale samples are reweighted rather than
clipped away. Not decoupled: the ratio is current / behaviour, clipped
(plain off-policy PPO).

The mismatch correction (`LossConfig.correction`) acts on the behaviour
weight w = proximal / behaviour: the gap between the engine that sampled a
token and the trainer that learns from it (a different kernel, precision or
version). At token level w is each token's; at sequence level it is the
geometric mean of its sample's token weights, one per sample.

* ``truncate`` (TIS, Yao et al., 2025): decoupled, each token weighs
  min(w, high).
* ``mask`` (MIS; IcePop, Ling team, 2025, with a lower bound): tokens (or
  whole samples) whose w lies outside [low, high] are left out of the loss;
  decoupled, the others weigh w, else 1 (the ratio already holds the
  behaviour policy).
* ``none``: decoupled, every token weighs 1; not decoupled, nothing is done.

The objective (`LossConfig.objective`):

* ``ppo``: the clipped surrogate per token, as above.
* ``gspo`` (Zheng et al., 2025): the ratio is the sequence's, the geometric
  mean of its token ratios, clipped per sequence; per token it is
  sg(s) * p / sg(p) (GSPO-token), so the normaliser (`loss_norm =
  "sequences"` for the paper's) says how samples add up.
* ``cispo`` (MiniMax-M1, 2025): the clipped ratio is a weight without
  gradient on every token's log-probability: no token's gradient is
  dropped by the clip, as PPO drops those outside the trust region.

With one optimizer step per batch the proximal policy equals the current
one before the step, so its log-probabilities are the current ones,
detached: no extra forward pass is needed.

Teacher terms (see `kl_to_reference`, `topk_reverse_kl`): a KL penalty to a
frozen reference, and on-policy distillation towards a reference model, by the
sampled token's reverse KL as a per-token advantage or by the reverse KL
over the reference's top-k tokens as a loss; both are reweighted by the same
behaviour importance weights as the policy loss.

The loss works on flat per-token tensors (the tokens of every sample of a
micro-batch, concatenated); the advantages on per-sample ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, *, kind: str = "grpo", normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages from per-sample rewards, within each group.

    grpo: ``(r - mean(group)) / (std(group) + eps)`` (population std; without
    `normalize_std`, just ``r - mean``). rloo: ``r - mean(others in the
    group)``, i.e. ``n / (n - 1) * (r - mean)``; a group of one gets 0.
    """
    rewards = rewards.to(torch.float64)
    groups, index = torch.unique(group, return_inverse=True)
    count = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, index, torch.ones_like(rewards))
    total = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, index, rewards)
    mean = (total / count)[index]
    centred = rewards - mean
    if kind == "rloo":
        n = count[index]
        out = torch.where(n > 1, centred * n / (n - 1).clamp(min=1), torch.zeros_like(centred))
    elif kind == "grpo":
        out = centred
        if normalize_std:
            var = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, index, centred**2) / count
            std = var.sqrt()[index]
            out = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    else:
        raise ValueError(f"unknown advantage estimator {kind!r}")
    return out.to(torch.float32)


def uniform_groups(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Per sample: True where every reward of its group is the same (no signal)."""
    groups, index = torch.unique(group, return_inverse=True)
    high = torch.full((len(groups),), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, index, rewards, "amax")
    low = torch.full((len(groups),), torch.inf, dtype=rewards.dtype).scatter_reduce(0, index, rewards, "amin")
    return (high == low)[index]


def normaliser_weights(lengths: torch.Tensor, trained: torch.Tensor, norm: str) -> torch.Tensor:
    """Per sample trained on, the factor that turns the trainer's token mean
    over the tokens it trains on into the normaliser `norm`.

    The trainer divides the policy loss's sum over tokens by the number of
    tokens it trains on, T (no-signal groups are left out before). The
    surrogate is linear in the advantage, so scaling sample i's advantage by
    its factor w_i gives, over the batch's N samples of lengths L_i:

    * ``trained_tokens``: w_i = 1, the sum over trained tokens / T;
    * ``batch_tokens``: w_i = T / sum(L), the sum over trained tokens /
      every response token of the batch, no-signal samples included (DAPO's
      token mean: a batch with less signal moves the policy less);
    * ``sequences``: w_i = T / (N L_i), the mean over the batch's samples
      of each sample's token mean (GRPO's; no-signal samples count 0).

    `lengths`: response tokens of every sample of the batch; `trained`: a
    mask of the samples trained on. Returns one factor per trained sample.
    """
    lengths = lengths.to(torch.float64)
    kept = lengths[trained]
    total = kept.sum()
    if norm == "trained_tokens" or total == 0:
        out = torch.ones_like(kept)
    elif norm == "batch_tokens":
        out = torch.full_like(kept, float(total / lengths.sum()))
    elif norm == "sequences":
        out = total / (len(lengths) * kept.clamp(min=1))
    else:
        raise ValueError(f"unknown loss normaliser {norm!r}")
    return out.to(torch.float32)


OBJECTIVES = ("ppo", "gspo", "cispo")
CORRECTIONS = ("none", "truncate", "mask")
LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    decoupled: bool = True
    objective: str = "ppo"
    correction: str = "none"
    level: str = "token"
    low: float = 0.0
    """mask: the least behaviour weight kept (0: no lower bound)."""
    high: float = 2.0
    """truncate: the cap of the behaviour weight; mask: the most kept."""

    def __post_init__(self) -> None:
        for name, value, allowed in (("objective", self.objective, OBJECTIVES),
                                     ("correction", self.correction, CORRECTIONS), ("level", self.level, LEVELS)):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}: one of {', '.join(allowed)}")
        if self.correction == "truncate" and not self.decoupled:
            raise ValueError("correction 'truncate' reweights the proximal policy's gap to the behaviour "
                             "policy: it needs decoupled (not decoupled, the ratio already holds it; use 'mask')")
        if self.correction == "truncate" and self.low > 0:
            raise ValueError("a lower bound is mask's: truncate only caps the weight at high")
        if not 0 <= self.low < self.high:
            raise ValueError(f"the bounds need 0 <= low < high, not low={self.low}, high={self.high}")


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Sum over tokens of the per-token loss (divide by the batch's token count)."""
    weight: torch.Tensor
    """Per token, the behaviour weight applied (1 without the correction; 0 where masked), detached:
    other per-token terms of the objective are reweighted by it too."""
    clipped: torch.Tensor
    """Tokens whose ratio was clipped (count)."""
    ratio_mean: torch.Tensor
    behaviour_weight_mean: torch.Tensor
    truncated: torch.Tensor
    """Tokens whose behaviour weight hit the cap (count)."""
    masked: torch.Tensor
    """Tokens left out by the mask (count)."""
    approx_kl: torch.Tensor
    """Sum over tokens of ``behaviour - proximal`` log-probability (a KL estimate times tokens)."""


def sample_mean(values: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """Per token, the mean of `values` over the tokens of its sample (`sample`:
    each token's sample, any integers)."""
    _, index = torch.unique(sample, return_inverse=True)
    size = int(index.max()) + 1 if len(index) else 0
    total = torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, index, values)
    count = torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, index, torch.ones_like(values))
    return (total / count)[index]


def policy_loss(
    logprobs: torch.Tensor,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    cfg: LossConfig,
    sample: torch.Tensor | None = None,
) -> LossOutput:
    """The objective summed over tokens (all arguments per token).

    `proximal` and `behaviour` are log-probabilities without gradients; the
    caller divides `loss` by the number of tokens in the whole batch, so that
    micro-batches add up to a token-mean. `sample` (each token's sample) is
    needed by what works per sequence: GSPO, and a sequence-level correction.
    """
    proximal = proximal.detach()
    behaviour = behaviour.detach()
    if sample is None and (cfg.objective == "gspo" or (cfg.level == "sequence" and cfg.correction != "none")):
        raise ValueError(f"objective {cfg.objective!r} at level {cfg.level!r} needs each token's sample")
    anchor = proximal if cfg.decoupled else behaviour
    log_ratio = logprobs - anchor
    if cfg.objective == "gspo":
        assert sample is not None
        sequence = sample_mean(log_ratio.detach(), sample)
        log_ratio = sequence + logprobs - logprobs.detach()  # sg(s) * p / sg(p): the value is s
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    if cfg.objective == "cispo":
        surrogate = clipped_ratio.detach() * advantages * logprobs
        was_clipped = (ratio.detach() != clipped_ratio.detach()).sum()
    else:
        surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
        with torch.no_grad():
            was_clipped = ((ratio * advantages) > (clipped_ratio * advantages)).sum()
    weight, truncated, masked = behaviour_weight(proximal, behaviour, cfg, sample)
    loss = -(weight * surrogate).sum()
    return LossOutput(
        loss=loss,
        weight=weight,
        clipped=was_clipped,
        ratio_mean=ratio.detach().mean() if ratio.numel() else torch.zeros(()),
        behaviour_weight_mean=weight.mean() if weight.numel() else torch.zeros(()),
        truncated=truncated,
        masked=masked,
        approx_kl=(behaviour - proximal).sum(),
    )


def behaviour_weight(proximal: torch.Tensor, behaviour: torch.Tensor, cfg: LossConfig,
                     sample: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token, the weight the mismatch correction gives the token's loss,
    and the counts of tokens it truncated and masked."""
    none = torch.zeros((), dtype=torch.long)
    if cfg.correction == "none":
        return torch.ones_like(proximal), none, none
    log_w = proximal - behaviour
    if cfg.level == "sequence":
        assert sample is not None
        log_w = sample_mean(log_w, sample)
    w = torch.exp(log_w)
    if cfg.correction == "truncate":
        return w.clamp(max=cfg.high), (w > cfg.high).sum(), none
    kept = (w >= cfg.low) & (w <= cfg.high)
    weight = (w if cfg.decoupled else torch.ones_like(w)) * kept
    return weight, none, (~kept).sum()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) at `targets`, computed stably."""
    return logprobs_at(logits, targets.unsqueeze(-1), temperature).squeeze(-1)


def logprobs_at(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) at `ids` ([tokens, k]), without a second
    [tokens, vocabulary] tensor: the gathered logits minus their logsumexp."""
    if temperature != 1.0:
        logits = logits / temperature
    logits = logits.float()
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


def kl_to_reference(logprobs: torch.Tensor, reference: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per token, an estimate of KL(policy || reference) from the sampled
    token's log-probabilities under each (the token was sampled from the
    policy). k1: ``log p - log ref`` (unbiased, can be negative); k3:
    ``ref / p - 1 - log(ref / p)`` (unbiased, never negative, lower variance)."""
    if estimator == "k1":
        return logprobs - reference
    if estimator == "k3":
        log_ratio = reference - logprobs
        return torch.exp(log_ratio) - 1 - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def topk_reverse_kl(student: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per token, KL(student || target) over the target model's top-k tokens,
    both renormalised to that set: ``student`` and ``target`` are the two
    models' log-probabilities of the same k tokens ([tokens, k])."""
    s = student - torch.logsumexp(student, dim=-1, keepdim=True)
    t = target - torch.logsumexp(target, dim=-1, keepdim=True)
    return (s.exp() * (s - t)).sum(-1)
