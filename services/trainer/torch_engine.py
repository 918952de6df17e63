"""The trainer's torch engine: a Hugging Face causal LM trained with GRPO / RLOO,
or with PPO's per-token GAE advantages from the batch's columns.

The model class is the Hugging Face class of the rollout's model, so the
names of its parameters are the names vLLM loads. One optimizer step per
batch: advantages within each group, groups without signal left out,
samples packed into micro-batches of at most `micro_batch_tokens` tokens,
gradients accumulated as a token mean over the whole batch, clipped, AdamW.
See `rlflow.algo.losses` for the loss and its off-policy corrections.

The trainer's replicas are ranks of one model sharded with FSDP2 (see
`fsdp`). A step is two halves: `prepare` (rank 0) does what needs the whole
batch (rewards, advantages within each group, which samples to train on,
the statistics of the batch) and deals the samples to the ranks by tokens
(`rlflow.algo.balance`); `step` (every rank, in lock step) trains on its
share: each rank's loss is the sum over its tokens divided by the token
count of the whole step, and the gradients are summed over the ranks, so
the step is the token mean over the batch whatever the number of ranks.

What trains and leaves is chosen once, at start: the whole model
(`trained.WholeWeights`) or, with LoRA (`TorchTrainer.lora`), an adapter on
the frozen base (`lora.AdapterWeights`); the engine asks it for every
difference (its snapshots, checksums, pieces, checkpoints, and a KL
penalty's reference). The learning rate: `schedule`; checkpoints:
`checkpoint`; the engine behind the trainer service, with the weight group
it sends over: `torch_trainer`.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import torch
from rlflow.protocol import FinishReason, SampleBatch, Tensor, samples, take
from rlflow.services.fsdp import Solo, autocast, bf16_passes
from rlflow.services.trainer import checkpoint
from rlflow.services.trainer.lora import AdapterWeights
from rlflow.services.trainer.packing import (
    attention_weight, can_share, column, logits_at, loss_mask, own, pack, prompt_units, token_mean, unit_width,
)
from rlflow.services.trainer.schedule import learning_rate
from rlflow.services.trainer.trained import TrainedWeights, WholeWeights

from rlflow.algo.balance import deal, micro_batches
from rlflow.algo.gap import Gap
from rlflow.algo.values import centre_by_returns, own_count, own_tokens, whiten
from rlflow.algo.losses import (
    LossConfig,
    group_advantages,
    kl_to_reference,
    logprobs_at,
    normaliser_weights,
    policy_loss,
    token_logprobs,
    topk_reverse_kl,
    uniform_groups,
)
from rlflow.config import TorchTrainer

__all__ = ["TorchEngine", "learning_rate"]

#: Sums a step's passes add to, over every rank (divided by its tokens at the end).
SUMS = ("loss", "clipped", "truncated", "masked", "kl", "ratio", "weight", "kl_loss", "distill_loss")


class TorchEngine:
    """Holds the policy (this rank's shards of it) and its optimizer."""

    def __init__(self, cfg: TorchTrainer, model_path: str, *, temperature: float = 1.0, seed: int = 0,
                 ranks: Solo | None = None, total_steps: int = 0, adapter: str = "",
                 max_tokens: int = 0, deterministic: bool = False):
        """`total_steps`: the run's steps, which a decaying learning rate needs (unless its own
        `lr_decay_steps` says how many it spans); `adapter`: with LoRA, the PEFT adapter directory to start
        from (empty: a new adapter); `max_tokens`: the rollout's longest response (over-long shaping);
        `deterministic`: torch's deterministic kernels only (`run.deterministic`)."""
        from transformers import AutoModelForCausalLM

        #: The steps the learning rate's schedule spans.
        self.total_steps = cfg.lr_decay_steps or total_steps
        if cfg.lr_decay != "none" and self.total_steps < 1:
            raise ValueError(f"lr_decay = {cfg.lr_decay!r} needs the run's step count")

        torch.manual_seed(seed)
        if deterministic:
            torch.use_deterministic_algorithms(True)
        threads = int(os.environ.get("RLFLOW_NUM_THREADS", "0") or 0)
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.model_path = model_path
        self.ranks = ranks or Solo()
        self.temperature = temperature if temperature > 0 else 1.0
        self.dtype = getattr(torch, cfg.dtype)
        #: bf16 forward and backward passes on a CPU (`mixed_precision`; CUDA's are FSDP's business).
        self.mixed = bf16_passes(cfg.mixed_precision, self.ranks.device)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        #: Whether a pass packs a group's samples in one row (`share_prompts`, where the model's attention
        #: takes the block mask), and what attention costs there against the linear layers.
        self.share_prompts = cfg.share_prompts and can_share(model.config)
        self.attention_weight = attention_weight(model.config) if self.share_prompts else 0.0
        #: The LoRA adapter trained on the frozen base (None: the whole model trains).
        self.lora = cfg.lora
        #: What trains, leaves and is saved: the whole model, or with LoRA the adapter alone.
        self.weights: TrainedWeights = (
            WholeWeights(model, self.ranks, cfg.bucket_bytes) if cfg.lora is None
            else AdapterWeights(model, self.ranks, cfg, adapter, temperature=self.temperature)
        )
        self.model = self.weights.model
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr, betas=tuple(cfg.betas),
            weight_decay=cfg.weight_decay,
        )
        self.loss_cfg = LossConfig(
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, decoupled=cfg.decoupled, objective=cfg.objective,
            correction=cfg.correction, level=cfg.correction_level, low=cfg.correction_low,
            high=cfg.correction_high,
        )
        if cfg.overlong_buffer and not max_tokens:
            raise ValueError("overlong_buffer needs the rollout's max_tokens")
        #: The rollout's longest response, which the over-long shaping measures against.
        self.max_tokens = max_tokens
        self.steps = 0
        #: The layout of what leaves the trainer, and its size in bytes.
        self.specs, self.nbytes = self.weights.specs, self.weights.nbytes

    # -- one step ---------------------------------------------------------------

    def train(self, batch: SampleBatch) -> dict[str, float]:
        """One optimizer step on the whole of `batch`, by a trainer of one rank."""
        if self.ranks.world != 1:
            raise RuntimeError("train() is one rank's whole step; with several ranks, prepare() and step() each")
        stats, (share,) = self.prepare(batch, 1)
        return {**stats, **self.step(share)}

    def prepare(self, batch: SampleBatch, ranks: int) -> tuple[dict[str, float], list[SampleBatch]]:
        """What needs the whole batch: the batch's statistics, and the samples to
        train on (each with its advantage) dealt into `ranks` shares by tokens."""
        cfg = self.cfg
        reads = cfg.reads()
        for key, value, name in reads:
            if getattr(batch, name) is None:
                raise ValueError(f"a batch without the column {name} reached a trainer with {key} = {value!r}")
        rows = list(samples(batch))
        w = cfg.distill_coef
        # A KL penalty (but to a LoRA adapter's base, which the trainer scores itself) or distillation.
        reference_terms = any(name == "teacher_logprobs" for _, _, name in reads)
        rewards = torch.tensor([r.reward if r.reward is not None else math.nan for r in rows], dtype=torch.float32)
        if torch.isnan(rewards).any() and w < 1:
            raise ValueError("a sample without a reward reached the trainer")
        stats: dict[str, float] = {}
        if reference_terms:
            stats["kl_teacher"] = token_mean(rows, lambda r: r.logprobs - r.teacher_logprobs)
        if cfg.kl_coef > 0 and cfg.kl_in == "reward":
            references = self.weights.reference_rows(rows)
            # Over the model's own tokens: an episode's observations are not the policy's to pay for.
            penalty = torch.tensor([
                float(own(
                    r, kl_to_reference(torch.from_numpy(r.logprobs), torch.as_tensor(ref), cfg.kl_estimator)
                ).sum())
                for r, ref in zip(rows, references)
            ])
            rewards = rewards - cfg.kl_coef * penalty
            stats["kl_penalty_mean"] = float(penalty.mean()) if len(rows) else 0.0
        if cfg.overlong_buffer > 0:
            # DAPO's soft over-long punishment, linear over the buffer before max_tokens.
            lengths = torch.tensor([len(r.response_ids) for r in rows], dtype=torch.float32)
            over = (lengths - (self.max_tokens - cfg.overlong_buffer)).clamp(min=0) / cfg.overlong_buffer
            penalty = cfg.overlong_penalty * over.clamp(max=1)
            rewards = rewards - penalty
            stats["overlong_penalty_mean"] = float(penalty.mean()) if len(rows) else 0.0
        if cfg.advantage == "gae":
            return self._prepare_gae(batch, rows, ranks, stats)
        group = torch.tensor([r.group.group_id for r in rows])
        advantages = group_advantages(rewards, group, kind=cfg.advantage, normalize_std=cfg.normalize_std)
        # Distillation has a signal at every token: only pure RL leaves out groups without one.
        uniform = uniform_groups(rewards, group) if cfg.skip_uniform_groups and w == 0 \
            else torch.zeros(len(rows), dtype=torch.bool)
        # Tokens trained on per sample: an episode's observations (loss mask 0) are not.
        responses = torch.tensor([own_count(r) for r in rows], dtype=torch.long)
        trained_mask = ~uniform & (responses > 0)
        if cfg.overlong_filter:  # DAPO's over-long filtering: what the length cap cut is not trained on
            cut = torch.tensor([r.finish_reason == FinishReason.LENGTH for r in rows], dtype=torch.bool)
            trained_mask &= ~cut
            stats["overlong_filtered_share"] = float(cut.float().mean()) if len(rows) else 0.0
        chosen = trained_mask.nonzero().flatten().tolist()
        stats["mixed_sample_share"] = float((~uniform).float().mean()) if len(rows) else 0.0
        if uniform.any():
            # Groups without signal split by cause (with 0/1 rewards: all right, all wrong): a filter
            # of such groups saves what is too easy and what is too hard now in different measure.
            stats["uniform_high_share"] = float((uniform & (rewards == rewards.max())).float().mean())
            stats["uniform_low_share"] = float((uniform & (rewards < rewards.max())).float().mean())
        stats["trained_tokens"] = float(responses[trained_mask].sum())
        # The loss normaliser as a factor on each advantage (the surrogate is linear in it).
        scaled = advantages[trained_mask] * normaliser_weights(responses, trained_mask, cfg.loss_norm)
        trained = msgspec.structs.replace(take(batch, chosen), advantages=Tensor.from_numpy(scaled.numpy()))
        return stats, self._shares(trained, ranks)

    def _shares(self, trained: SampleBatch, ranks: int) -> list[SampleBatch]:
        """`trained` dealt into `ranks` shares by tokens; with shared prompts, a unit of samples
        sharing a prompt (`packing.prompt_units`, none wider than an even share) goes to one rank whole."""
        rows = list(samples(trained))
        units = self._units(rows)
        if ranks > 1 and units:
            even = -(-sum(unit_width(rows, u) for u in units) // ranks)
            units = self._units(rows, min(self.cfg.micro_batch_tokens, even))
        shares = deal([unit_width(rows, u) for u in units], ranks)
        return [take(trained, sorted(i for u in share for i in units[u])) for share in shares]

    def _units(self, rows: list, budget: int = 0) -> list[list[int]]:
        """What each row of a pass holds, at most `budget` tokens (0: `micro_batch_tokens`): the samples
        of one prompt (`share_prompts`), or one sample."""
        if self.share_prompts:
            return prompt_units(rows, budget or self.cfg.micro_batch_tokens, self.attention_weight)
        return [[i] for i in range(len(rows))]

    def _prepare_gae(self, batch: SampleBatch, rows: list, ranks: int,
                     stats: dict[str, float]) -> tuple[dict[str, float], list[SampleBatch]]:
        """advantage = "gae": the per-token advantages the batch carries, scaled over the
        step's tokens if asked; every sample with a response is trained on (one
        sample per prompt has no group to compare within)."""
        assert batch.token_advantages is not None  # `prepare` refused a batch without the columns it reads
        chosen = [i for i in range(len(rows)) if len(rows[i].response_ids) > 0]
        trained = take(batch, chosen)
        tokens = trained.token_advantages.numpy().astype(np.float64)
        # Statistics and whitening over the policy's own tokens (an episode's observations are not trained on).
        keep = own_tokens(list(samples(trained)))
        own = tokens[keep]
        stats["advantage_mean"] = float(own.mean()) if own.size else 0.0
        stats["advantage_std"] = float(own.std()) if own.size else 0.0
        if self.cfg.advantage_norm == "whiten":
            tokens[keep] = whiten(own)
        elif self.cfg.advantage_norm == "returns":
            tokens[keep] = centre_by_returns(own, trained.returns.numpy()[keep])
        offsets = trained.response_offsets.numpy()
        per_sample = np.add.reduceat(tokens, offsets[:-1]) / np.diff(offsets) if len(chosen) else tokens
        stats["trained_tokens"] = float(keep.sum())
        trained = msgspec.structs.replace(trained, token_advantages=Tensor.from_numpy(tokens.astype(np.float32)),
                                          advantages=Tensor.from_numpy(np.asarray(per_sample, np.float32)))
        return stats, self._shares(trained, ranks)

    def step(self, share: SampleBatch) -> dict[str, float]:
        """This rank's part of one optimizer step (every rank at once: each
        forward and backward pass gathers and scatters with every rank)."""
        cfg = self.cfg
        rows = list(samples(share))
        if rows and share.advantages is None:
            raise ValueError("a share of a step without advantages")
        advantages = share.advantages.torch() if share.advantages is not None else torch.zeros(0)
        units = self._units(rows)
        micro = [[units[u] for u in part] for part in
                 micro_batches([unit_width(rows, u) for u in units], cfg.micro_batch_tokens)]
        # Every rank takes as many passes (the collectives pair up), and
        # divides by the tokens of the whole step.
        passes = self.ranks.max(len(micro))
        (tokens,) = self.ranks.sum([float(sum(own_count(r) for r in rows))])
        self._set_lr()
        if tokens == 0:
            # Nothing to learn from; the version still advances, so that the
            # pipeline's clock stays one step per batch.
            self.steps += 1
            return {"loss": 0.0, "grad_norm": 0.0, "lr": self._lr()}
        sums = dict.fromkeys(SUMS, 0.0)
        gap = Gap()
        for i in range(passes):
            if i < len(micro):
                chosen = [j for unit in micro[i] for j in unit]
                self._pass([rows[j] for j in chosen], _renumbered(micro[i]), advantages[chosen], tokens, sums, gap)
            else:
                self._idle_pass()
        sums = dict(zip(SUMS, self.ranks.sum(list(sums.values()))))
        gap_stats = gap.stats(self.ranks)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        out = {
            "loss": sums["loss"] / tokens,
            "clipped_share": sums["clipped"] / tokens,
            "truncated_share": sums["truncated"] / tokens,
            "masked_share": sums["masked"] / tokens,
            **gap_stats,
            "behaviour_kl": sums["kl"] / tokens,
            "behaviour_weight_mean": sums["weight"] / tokens,
            "grad_norm": float(norm),
            "lr": self._lr(),
            "micro_batches": float(passes),
        }
        if cfg.kl_coef > 0 and cfg.kl_in == "loss":
            out["kl_loss"] = sums["kl_loss"] / tokens
        if cfg.distill_coef > 0 and cfg.distill == "topk":
            out["distill_loss"] = sums["distill_loss"] / tokens
        return out

    def _pass(self, part: list, units: list[list[int]], advantages: torch.Tensor, tokens: float,
              sums: dict[str, float], gap: Gap) -> None:
        """Forward and backward over one micro-batch (a row per unit of `units`), its loss scaled by 1 / `tokens`."""
        cfg, w, device = self.cfg, self.cfg.distill_coef, self.ranks.device
        packed = pack(part, units)
        keep = loss_mask(part)
        if keep is not None:  # the loss mask: an episode's observations are not trained on
            where = packed.where
            packed = packed._replace(targets=packed.targets[keep], where=(where[0][keep], where[1][keep]))
        with autocast(self.mixed):
            logits = logits_at(self.model, packed, device)
        logits = logits.float() if self.mixed else logits
        targets = packed.targets.to(device)
        if w > 0 and cfg.distill == "topk":
            # The sampled token and the reference's top k from one log-softmax: a single
            # [tokens, vocabulary] gradient in the backward pass, as for plain GRPO.
            topk = column(part, "teacher_topk_ids", keep).long().to(device)
            both = logprobs_at(logits, torch.cat([targets.unsqueeze(-1), topk], dim=-1), self.temperature)
            logprobs, student = both[:, 0], both[:, 1:]
        else:
            logprobs = token_logprobs(logits, targets, self.temperature)
        behaviour = column(part, "logprobs", keep).to(device)
        adv = torch.cat([a.repeat(len(r.response_ids)) for a, r in zip(advantages, part)])
        adv = (adv if keep is None else adv[keep]).to(device)
        if cfg.advantage == "gae":  # per token, from the batch
            adv = column(part, "token_advantages", keep).to(device)
        if w > 0 and cfg.distill == "sampled":
            # The sampled token's reverse KL to the reference, as an advantage.
            adv = (1 - w) * adv + w * (column(part, "teacher_logprobs", keep).to(device) - behaviour)
        sample = _sample_of(part, keep).to(device)
        out = policy_loss(logprobs, logprobs.detach(), behaviour, adv, self.loss_cfg, sample)
        gap.add(logprobs, behaviour, sample)
        loss = out.loss
        if w > 0 and cfg.distill == "topk":
            per_token = topk_reverse_kl(student, column(part, "teacher_topk_logprobs", keep).to(device))
            distill = (out.weight * per_token).sum()
            loss = (1 - w) * loss + w * distill
            sums["distill_loss"] += distill.item()
        if cfg.kl_coef > 0 and cfg.kl_in == "loss":
            reference = self.weights.reference(part, packed, keep)
            kl = (out.weight * kl_to_reference(logprobs, reference, cfg.kl_estimator)).sum()
            loss = loss + cfg.kl_coef * kl
            sums["kl_loss"] += kl.item()
        # Scaled so that the gradients add up (over passes and ranks) to the mean over every token.
        (loss / tokens).backward()
        sums["loss"] += loss.item()
        sums["clipped"] += out.clipped.item()
        sums["truncated"] += float(out.truncated)
        sums["masked"] += float(out.masked)
        sums["kl"] += out.approx_kl.item()
        sums["ratio"] += out.ratio_mean.item() * len(adv)
        sums["weight"] += out.behaviour_weight_mean.item() * len(adv)

    def _idle_pass(self) -> None:
        """A pass of nothing, for a rank with fewer micro-batches than another:
        its gathers and scatters pair with theirs; its gradient is zero."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.ranks.device)
        if self.cfg.kl_in == "loss":
            self.weights.idle_reference(ids)
        (self.model(input_ids=ids).logits.sum() * 0.0).backward()

    def _lr(self) -> float:
        return learning_rate(self.cfg, self.steps, self.total_steps)

    def _set_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()

    # -- weights out (see `trained`) -----------------------------------------------

    def snapshot(self) -> list[torch.Tensor]:
        """The weights of the version made now, as this rank keeps them until sent (`TrainedWeights.snapshot`)."""
        return self.weights.snapshot()

    def checksum(self, snapshot: list[torch.Tensor]) -> str:
        """The checksum of `snapshot` (SPEC.md, *Checksums*; empty: not checked)."""
        return self.weights.checksum(snapshot)

    def pieces(self, snapshot: list[torch.Tensor]) -> Iterator[torch.Tensor | None]:
        """The flat buffer of `snapshot`, piece by piece (`TrainedWeights.pieces`)."""
        return self.weights.pieces(snapshot)

    def named_full(self, snapshot: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole parameter) of `snapshot`, in the layout's order (`TrainedWeights.named_full`)."""
        return self.weights.named_full(snapshot)

    def send_named(self, snapshot: list[torch.Tensor],
                   send: Callable[[Iterator[tuple[str, torch.Tensor]]], None] | None) -> None:
        """Gather `snapshot` and hand it to `send` parameter by parameter (`TrainedWeights.send_named`)."""
        self.weights.send_named(snapshot, send)

    def send(self, snapshot: list[torch.Tensor], broadcast: Callable[[torch.Tensor], None] | None) -> None:
        """Gather `snapshot` and hand it to `broadcast` piece by piece (`TrainedWeights.send`)."""
        self.weights.send(snapshot, broadcast)

    # -- checkpoints (see `checkpoint`) -----------------------------------------------

    def save(self, folder: pathlib.Path, run_state: dict[str, Any]) -> None:
        """The weights (a Hugging Face model directory; with LoRA the adapter in PEFT's format under
        adapter/, and the merged model only if asked for) plus optimizer, RNG and run state (every rank)."""
        checkpoint.save(folder, run_state, weights=self.weights, optimizer=self.optimizer, steps=self.steps,
                        model_path=self.model_path, dtype=self.dtype)

    def load_state(self, folder: pathlib.Path) -> dict[str, Any]:
        """Restore optimizer and RNG state saved by `save` (on any number of
        ranks); the run state. The weights are the folder's model, loaded at start."""
        self.steps, run_state = checkpoint.load(folder, weights=self.weights, optimizer=self.optimizer)
        return run_state


def _renumbered(units: list[list[int]]) -> list[list[int]]:
    """`units` as indices into the list of their samples in order (what a pass packs)."""
    out, start = [], 0
    for unit in units:
        out.append(list(range(start, start + len(unit))))
        start += len(unit)
    return out


def _sample_of(part: list, keep: torch.Tensor | None) -> torch.Tensor:
    """Each response token's sample (its index in `part`), at the tokens `keep` says are trained on."""
    lengths = torch.tensor([len(r.response_ids) for r in part])
    sample = torch.repeat_interleave(torch.arange(len(part)), lengths)
    return sample if keep is None else sample[keep]
