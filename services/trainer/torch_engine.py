"""The trainer's torch engine: a Hugging Face causal LM trained with GRPO / RLOO,
or with PPO's per-token GAE advantages from the critic role.

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
penalty's reference). Weights leave in pieces over gloo on the CPU
(`WeightsGloo`); on CUDA the trainer offers `WeightsNccl` and rank 0 hands
the gathered parameters to vLLM's packed NCCL broadcast instead, which packs
the next chunk while the last is sent (the same gather, another backend).
Checkpoints: see `checkpoint`; the learning rate: `schedule`.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import torch
import trio
from rlflow.protocol import (
    Adapter, ParamSpec, SampleBatch, Tensor, WeightsGloo, WeightsNccl, WeightsPayload, WeightsZmq, WeightTransfer,
    samples, take,
)
from rlflow.services.base import EngineContext
from rlflow.services.fsdp import Sharded, Solo, autocast, bf16_passes, rendezvous
from rlflow.services.trainer import checkpoint
from rlflow.services.trainer.lora import AdapterWeights, adapter_offer
from rlflow.services.trainer.packing import column, loss_mask, own, pack, token_mean
from rlflow.services.trainer.schedule import learning_rate
from rlflow.services.trainer.trained import TrainedWeights, WholeWeights
from rlflow.services.weights import GlooGroup, NcclGroup
from rlflow.services.zmq_weights import WeightServer

from rlflow.algo.balance import deal, micro_batches
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
from rlflow.data.net import listener

__all__ = ["TorchEngine", "TorchTrainerEngine", "learning_rate", "weight_offer"]

#: Sums a step's passes add to, over every rank (divided by its tokens at the end).
SUMS = ("loss", "clipped", "truncated", "kl", "ratio", "weight", "kl_loss", "distill_loss")


class TorchEngine:
    """Holds the policy (this rank's shards of it) and its optimizer."""

    def __init__(self, cfg: TorchTrainer, model_path: str, *, temperature: float = 1.0, seed: int = 0,
                 ranks: Solo | None = None, total_steps: int = 0, adapter: str = ""):
        """`total_steps`: the run's steps, which a decaying learning rate needs (unless its own
        `lr_decay_steps` says how many it spans); `adapter`: with LoRA, the PEFT adapter directory to start
        from (empty: a new adapter)."""
        from transformers import AutoModelForCausalLM

        #: The steps the learning rate's schedule spans.
        self.total_steps = cfg.lr_decay_steps or total_steps
        if cfg.lr_decay != "none" and self.total_steps < 1:
            raise ValueError(f"lr_decay = {cfg.lr_decay!r} needs the run's step count")

        torch.manual_seed(seed)
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
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, decoupled=cfg.decoupled, tis_cap=cfg.tis_cap
        )
        self.steps = 0
        #: The layout of what leaves the trainer, and its size in bytes.
        self.specs, self.nbytes = self.weights.specs, self.weights.nbytes

    @property
    def base_reference(self) -> bool:
        """Whether a KL penalty's reference is the base with the adapter off (LoRA, `reference = "base"`)."""
        return self.weights.base_reference

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
        rows = list(samples(batch))
        w = cfg.distill_coef
        teacher_terms = w > 0 or (cfg.kl_coef > 0 and not self.base_reference)
        if teacher_terms and any(r.teacher_logprobs is None for r in rows):
            raise ValueError("a sample without the teacher's log-probabilities reached a trainer that needs them")
        rewards = torch.tensor([r.reward if r.reward is not None else math.nan for r in rows], dtype=torch.float32)
        if torch.isnan(rewards).any() and w < 1:
            raise ValueError("a sample without a reward reached the trainer")
        stats: dict[str, float] = {}
        if teacher_terms:
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
        lengths = [len(rows[i].prompt_ids) + len(rows[i].response_ids) for i in chosen]
        return stats, [take(trained, part) for part in deal(lengths, ranks)]

    def _prepare_gae(self, batch: SampleBatch, rows: list, ranks: int,
                     stats: dict[str, float]) -> tuple[dict[str, float], list[SampleBatch]]:
        """advantage = "gae": the critic's per-token advantages, scaled over the
        step's tokens if asked; every sample with a response is trained on (one
        sample per prompt has no group to compare within)."""
        if batch.token_advantages is None:
            raise ValueError("a batch without the critic's advantages reached a trainer with advantage = 'gae'")
        if batch.returns is None and self.cfg.advantage_norm == "returns":
            raise ValueError("a batch without the critic's returns reached a trainer with advantage_norm = 'returns'")
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
        lengths = [len(rows[i].prompt_ids) + len(rows[i].response_ids) for i in chosen]
        return stats, [take(trained, part) for part in deal(lengths, ranks)]

    def step(self, share: SampleBatch) -> dict[str, float]:
        """This rank's part of one optimizer step (every rank at once: each
        forward and backward pass gathers and scatters with every rank)."""
        cfg = self.cfg
        rows = list(samples(share))
        if rows and share.advantages is None:
            raise ValueError("a share of a step without advantages")
        advantages = share.advantages.torch() if share.advantages is not None else torch.zeros(0)
        micro = micro_batches([len(r.prompt_ids) + len(r.response_ids) for r in rows], cfg.micro_batch_tokens)
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
        for i in range(passes):
            if i < len(micro):
                self._pass([rows[j] for j in micro[i]], advantages[micro[i]], tokens, sums)
            else:
                self._idle_pass()
        sums = dict(zip(SUMS, self.ranks.sum(list(sums.values()))))
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

    def _pass(self, part: list, advantages: torch.Tensor, tokens: float, sums: dict[str, float]) -> None:
        """Forward and backward over one micro-batch, its loss scaled by 1 / `tokens`."""
        cfg, w, device = self.cfg, self.cfg.distill_coef, self.ranks.device
        ids, mask, targets, where = pack(part)
        keep = loss_mask(part)
        if keep is not None:  # the loss mask: an episode's observations are not trained on
            targets, where = targets[keep], (where[0][keep], where[1][keep])
        with autocast(self.mixed):
            logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[
                where[0].to(device), where[1].to(device)
            ]
        logits = logits.float() if self.mixed else logits
        targets = targets.to(device)
        if w > 0 and cfg.distill == "topk":
            # The sampled token and the teacher's top k from one log-softmax: a single
            # [tokens, vocabulary] gradient in the backward pass, as for plain GRPO.
            topk = column(part, "teacher_topk_ids", keep).long().to(device)
            both = logprobs_at(logits, torch.cat([targets.unsqueeze(-1), topk], dim=-1), self.temperature)
            logprobs, student = both[:, 0], both[:, 1:]
        else:
            logprobs = token_logprobs(logits, targets, self.temperature)
        behaviour = column(part, "logprobs", keep).to(device)
        adv = torch.cat([a.repeat(len(r.response_ids)) for a, r in zip(advantages, part)])
        adv = (adv if keep is None else adv[keep]).to(device)
        if cfg.advantage == "gae":  # per token, from the critic
            adv = column(part, "token_advantages", keep).to(device)
        if w > 0 and cfg.distill == "sampled":
            # The sampled token's reverse KL to the teacher, as an advantage.
            adv = (1 - w) * adv + w * (column(part, "teacher_logprobs", keep).to(device) - behaviour)
        out = policy_loss(logprobs, logprobs.detach(), behaviour, adv, self.loss_cfg)
        loss = out.loss
        if w > 0 and cfg.distill == "topk":
            per_token = topk_reverse_kl(student, column(part, "teacher_topk_logprobs", keep).to(device))
            distill = (out.weight * per_token).sum()
            loss = (1 - w) * loss + w * distill
            sums["distill_loss"] += distill.item()
        if cfg.kl_coef > 0 and cfg.kl_in == "loss":
            reference = self.weights.reference(part, (ids, mask, targets, where), keep)
            kl = (out.weight * kl_to_reference(logprobs, reference, cfg.kl_estimator)).sum()
            loss = loss + cfg.kl_coef * kl
            sums["kl_loss"] += kl.item()
        # Scaled so that the gradients add up (over passes and ranks) to the mean over every token.
        (loss / tokens).backward()
        sums["loss"] += loss.item()
        sums["clipped"] += out.clipped.item()
        sums["truncated"] += float(out.truncated)
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


class TorchTrainerEngine:
    """`TorchEngine` behind the trainer service's interface: one rank of the
    trainer, its steps in a worker thread; rank 0 hosts a gloo group with
    every rollout replica and broadcasts the weights there; checkpoints
    land where the service says."""

    def __init__(self, cfg: TorchTrainer, ctx: EngineContext) -> None:
        config = ctx.config
        rollout = config.roles.rollout.engine
        self.replicas = ctx.replicas
        self.ranks = Sharded(ctx.rank, ctx.replicas, *rendezvous(ctx.replicas),
                             timeout_s=config.cluster.handshake_timeout_s + 1800.0)
        self.engine = TorchEngine(
            cfg,
            config.policy_path,
            temperature=getattr(rollout, "temperature", 1.0),
            seed=config.run.seed,
            ranks=self.ranks,
            total_steps=config.run.steps,
            adapter=config.adapter_path,
        )
        #: With LoRA, the adapter its weight updates carry (its `Hello.adapter`).
        self.adapter: Adapter | None = adapter_offer(cfg.lora, config.run.staleness) if cfg.lora else None
        self.checkpoint_every = cfg.checkpoint_every
        self.cluster = config.cluster
        self.host = ctx.host
        #: Where rank 0 will host the weight group it offers: listening since it was offered, so that
        #: no other process takes the port while the receivers start (`compat.master_store`).
        self._listener: socket.socket | None = None
        self.ranks_per_receiver = getattr(rollout, "tensor_parallel_size", 1)
        self.group: GlooGroup | NcclGroup | None = None
        #: An adapter over ZeroMQ (`Lora.transfer`): the replicas fetch it from rank 0's weight server; no
        #: group to host, nothing to send.
        self.pulled = cfg.lora is not None and cfg.lora.transfer == "zmq"
        self.server = WeightServer(ctx) if self.pulled and self.ranks.lead else None
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self._published: dict[int, trio.Event] = {}
        if config.run.resume:
            self.engine.load_state(pathlib.Path(config.run.resume))

    def offer(self) -> tuple[WeightTransfer, list[ParamSpec]]:
        engine = self.engine
        if self.server is not None:
            return WeightsZmq(address=self.server.address), engine.specs
        if self._listener is None:
            self._listener = listener(self.host)
        return weight_offer(self.ranks.device.type, self.host, self._listener.getsockname()[1], engine.nbytes,
                            engine.cfg.bucket_bytes, self.ranks_per_receiver), engine.specs

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """An adapter over ZeroMQ: the weight server; else weights are pushed when the controller
        says so: nothing to serve."""
        if self.server is not None:
            await self.server.serve(task_status=task_status)
        else:
            task_status.started()

    async def connect(self, transfer: WeightTransfer | None, *, first: bool = True) -> None:
        """Host the weight group and wait until every receiver has joined (rank
        0; the other ranks only help gather): the first group as long as the
        services may take to start, a later generation `cluster.weight_timeout_s`."""
        if (transfer is None and not self.ranks.lead) or self.pulled:
            return  # over ZeroMQ there is no group
        offered = WeightsNccl if self.ranks.device.type == "cuda" else WeightsGloo
        if not isinstance(transfer, offered):
            raise ValueError(f"the torch trainer on {self.ranks.device.type} sends weights as {offered.__name__}; "
                             f"the controller asks for {transfer!r}")
        held = self._take_listener(transfer.port)
        if isinstance(transfer, WeightsNccl):
            self.group = await trio.to_thread.run_sync(
                functools.partial(NcclGroup, transfer, self.ranks.device, listener=held))
        else:
            timeout_s = max(self.cluster.handshake_timeout_s, self.cluster.weight_timeout_s) if first \
                else self.cluster.weight_timeout_s
            self.group = await trio.to_thread.run_sync(
                functools.partial(GlooGroup, transfer.host, transfer.port, 0, transfer.world_size, timeout_s,
                                  listener=held))

    def _take_listener(self, port: int) -> socket.socket | None:
        """The socket listening at `port` since it was offered, now the group's
        (None, and any other closed, if the controller names another port)."""
        held, self._listener = self._listener, None
        if held is not None and held.getsockname()[1] != port:
            held.close()
            held = None
        return held

    async def deal(self, batch: SampleBatch) -> tuple[dict[str, float], list[SampleBatch]]:
        return await trio.to_thread.run_sync(self.engine.prepare, batch, self.replicas)

    async def train(self, share: SampleBatch) -> dict[str, float]:
        return await trio.to_thread.run_sync(self.engine.step, share)

    async def publish(self, version: int) -> tuple[int, str]:
        snapshot = self.snapshots[version] = await trio.to_thread.run_sync(self.engine.snapshot)
        self._event(version).set()
        if self.server is not None:  # the adapter, whole at rank 0: served from now on
            self.server.publish(WeightsPayload(version=version, names=[s.name for s in self.engine.specs],
                                               tensors=[Tensor.from_torch(t) for t in snapshot]))
        return self.engine.nbytes, await trio.to_thread.run_sync(self.engine.checksum, snapshot)

    def _event(self, version: int) -> trio.Event:
        return self._published.setdefault(version, trio.Event())

    def new_group(self, transfer: WeightTransfer) -> WeightTransfer:
        """The next generation of the group, on a port this process listens on from now on."""
        if self._listener is not None:
            self._listener.close()
        self._listener = listener(self.host)
        return msgspec.structs.replace(transfer, host=self.host, port=self._listener.getsockname()[1],
                                       nbytes=self.engine.nbytes, bucket_bytes=self.engine.cfg.bucket_bytes)

    async def send(self, version: int, transfer: WeightTransfer | None, *, broadcast: bool = True) -> None:
        """Gather the weights of `version` with the other ranks; rank 0
        broadcasts them to the rollout replicas (joining `transfer`, a new
        generation of the group, first), unless not to `broadcast`."""
        if transfer is not None:
            self._let_go()
            await self.connect(transfer, first=False)
        await self._event(version).wait()  # this rank's own step may end a moment after rank 0's
        snapshot = self.snapshots[version]
        # Older versions will not be sent; this one is let go of once sent: a send that fails keeps
        # it, as the controller may move it again through a new generation of the group.
        self._forget(lambda v: v < version)
        if self.pulled:
            self._forget(lambda v: v == version)
            return  # served since it was published: the replicas fetch it
        group = self.group if self.ranks.lead and broadcast else None
        try:
            if isinstance(group, NcclGroup):
                await trio.to_thread.run_sync(self.engine.send_named, snapshot, functools.partial(_send_nccl, group))
            elif self.ranks.device.type == "cuda":  # a rank that only gathers
                await trio.to_thread.run_sync(self.engine.send_named, snapshot, None)
            else:
                broadcast = None if group is None else functools.partial(_broadcast, group)
                await trio.to_thread.run_sync(self.engine.send, snapshot, broadcast)
        except Exception:
            if self.group is group:
                self.group = None
            raise
        self._forget(lambda v: v == version)

    def _forget(self, which: Callable[[int], bool]) -> None:
        """Let go of the snapshots (and publish events) of the versions `which` picks."""
        for v in [v for v in self.snapshots if which(v)]:
            del self.snapshots[v]
            self._published.pop(v, None)

    def _let_go(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    async def save(self, folder: pathlib.Path, run_state: dict[str, int]) -> bool:
        await trio.to_thread.run_sync(self.engine.save, folder, run_state)
        return True

    async def close(self) -> None:
        self._let_go()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        # Abandoned if cancelled: a rank that died mid-step may leave this one's group unable to close.
        await trio.to_thread.run_sync(self.ranks.close, abandon_on_cancel=True)


def _broadcast(group: GlooGroup, piece: torch.Tensor) -> None:
    """One piece to every receiver. When it fails (a receiver died mid-way)
    the group is let go of at once: its connections close, and the receivers
    still waiting in this broadcast return (to join the next generation)."""
    try:
        group.broadcast(piece)
    except Exception:
        group.close()
        raise


def _send_nccl(group: NcclGroup, named: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Every parameter to every receiver; a failure lets go of the group."""
    try:
        group.send(named)
    except Exception:
        group.close()
        raise


def weight_offer(device: str, host: str, port: int, nbytes: int, bucket_bytes: int,
                 ranks_per_receiver: int = 1) -> WeightTransfer:
    """How a trainer on `device` ("cpu" or "cuda") sends weights: over gloo
    from the CPU, over NCCL (vLLM's `nccl` backend on the receivers, each
    `ranks_per_receiver` tensor-parallel workers) from a GPU."""
    if device == "cuda":
        return WeightsNccl(host=host, port=port, nbytes=nbytes, bucket_bytes=bucket_bytes,
                           ranks_per_receiver=ranks_per_receiver)
    return WeightsGloo(host=host, port=port, nbytes=nbytes, bucket_bytes=bucket_bytes)


