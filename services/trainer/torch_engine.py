"""The trainer's torch engine: a Hugging Face causal LM trained with GRPO / RLOO.

The model class is the Hugging Face class of the rollout's model, so the
names of its parameters are the names vLLM loads. One optimizer step per
batch: advantages within each group, groups without signal left out,
samples packed into micro-batches of at most `micro_batch_tokens` tokens,
gradients accumulated as a token mean over the whole batch, clipped, AdamW.
See `rlflow.algo.losses` for the loss and its off-policy corrections.

One process (the trainer runs as one replica); checkpoints are Hugging
Face directories (safetensors) plus optimizer, RNG and run state.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import random
import shutil
from typing import Any

import msgspec
import numpy as np
import torch
import trio

from rlflow.algo.losses import (
    LossConfig,
    group_advantages,
    kl_to_reference,
    logprobs_at,
    policy_loss,
    token_logprobs,
    topk_reverse_kl,
    uniform_groups,
)
from rlflow.config import TorchTrainer
from rlflow.data.net import free_port
from rlflow.protocol import ParamSpec, SampleBatch, WeightsGloo, WeightTransfer, samples
from rlflow.rundir import RUN_STATE, TRAINER_STATE
from rlflow.services.base import EngineContext
from rlflow.services.weights import GlooGroup, layout, pack


class TorchEngine:
    """Holds the policy and its optimizer; `train` takes one step on a batch."""

    def __init__(self, cfg: TorchTrainer, model_path: str, *, temperature: float = 1.0, seed: int = 0):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        threads = int(os.environ.get("RLFLOW_NUM_THREADS", "0") or 0)
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.model_path = model_path
        self.temperature = temperature if temperature > 0 else 1.0
        self.dtype = getattr(torch, cfg.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )
        self.loss_cfg = LossConfig(
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, decoupled=cfg.decoupled, tis_cap=cfg.tis_cap
        )
        self.steps = 0
        self.specs, self.nbytes = layout(self.model.named_parameters())

    # -- one step ---------------------------------------------------------------

    def train(self, batch: SampleBatch) -> dict[str, float]:
        """One optimizer step: the policy loss, and the teacher terms the config asks for."""
        cfg = self.cfg
        rows = list(samples(batch))
        w = cfg.distill_coef
        teacher_terms = w > 0 or cfg.kl_coef > 0
        if teacher_terms and any(r.teacher_logprobs is None for r in rows):
            raise ValueError("a sample without the teacher's log-probabilities reached a trainer that needs them")
        rewards = torch.tensor([r.reward if r.reward is not None else math.nan for r in rows], dtype=torch.float32)
        if torch.isnan(rewards).any() and w < 1:
            raise ValueError("a sample without a reward reached the trainer")
        stats: dict[str, float] = {}
        if teacher_terms:
            stats["kl_teacher"] = _token_mean(rows, lambda r: r.logprobs - r.teacher_logprobs)
        if cfg.kl_coef > 0 and cfg.kl_in == "reward":
            penalty = torch.tensor([
                float(kl_to_reference(torch.from_numpy(r.logprobs), torch.from_numpy(r.teacher_logprobs),
                                      cfg.kl_estimator).sum()) for r in rows
            ])
            rewards = rewards - cfg.kl_coef * penalty
            stats["kl_penalty_mean"] = float(penalty.mean()) if len(rows) else 0.0
        group = torch.tensor([r.group.group_id for r in rows])
        advantages = group_advantages(rewards, group, kind=cfg.advantage, normalize_std=cfg.normalize_std)
        # Distillation has a signal at every token: only pure RL leaves out groups without one.
        uniform = uniform_groups(rewards, group) if cfg.skip_uniform_groups and w == 0 else torch.zeros(len(rows), dtype=torch.bool)
        keep = ~uniform
        chosen = [i for i in range(len(rows)) if keep[i] and len(rows[i].response_ids) > 0]
        total_tokens = sum(len(rows[i].response_ids) for i in chosen)
        stats["mixed_sample_share"] = float(keep.float().mean()) if len(rows) else 0.0
        stats["trained_tokens"] = float(total_tokens)
        self._set_lr()
        if total_tokens == 0:
            # Nothing to learn from; the version still advances, so that the
            # pipeline's clock stays one step per batch.
            self.steps += 1
            return {**stats, "loss": 0.0, "grad_norm": 0.0, "lr": self._lr()}
        sums = dict.fromkeys(("loss", "clipped", "truncated", "kl", "ratio", "weight", "kl_loss", "distill_loss"), 0.0)
        micro = self._micro_batches(chosen, rows)
        for part in micro:
            ids, mask, targets, where = self._pack([rows[i] for i in part])
            logits = self.model(input_ids=ids, attention_mask=mask).logits[where]
            logprobs = token_logprobs(logits, targets, self.temperature)
            behaviour = _column(rows, part, "logprobs")
            adv = torch.cat([advantages[i].repeat(len(rows[i].response_ids)) for i in part])
            if w > 0 and cfg.distill == "sampled":
                # The sampled token's reverse KL to the teacher, as an advantage.
                adv = (1 - w) * adv + w * (_column(rows, part, "teacher_logprobs") - behaviour)
            out = policy_loss(logprobs, logprobs.detach(), behaviour, adv, self.loss_cfg)
            loss = out.loss
            if w > 0 and cfg.distill == "topk":
                student = logprobs_at(logits, _column(rows, part, "teacher_topk_ids").long(), self.temperature)
                per_token = topk_reverse_kl(student, _column(rows, part, "teacher_topk_logprobs"))
                distill = (out.weight * per_token).sum()
                loss = (1 - w) * loss + w * distill
                sums["distill_loss"] += distill.item()
            if cfg.kl_coef > 0 and cfg.kl_in == "loss":
                kl = (out.weight * kl_to_reference(logprobs, _column(rows, part, "teacher_logprobs"), cfg.kl_estimator)).sum()
                loss = loss + cfg.kl_coef * kl
                sums["kl_loss"] += kl.item()
            # Scaled so that the gradients add up to the mean over every token.
            (loss / total_tokens).backward()
            sums["loss"] += loss.item()
            sums["clipped"] += out.clipped.item()
            sums["truncated"] += float(out.truncated)
            sums["kl"] += out.approx_kl.item()
            sums["ratio"] += out.ratio_mean.item() * len(adv)
            sums["weight"] += out.behaviour_weight_mean.item() * len(adv)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        tokens = max(total_tokens, 1)
        out_stats = {
            **stats,
            "loss": sums["loss"] / tokens,
            "clipped_share": sums["clipped"] / tokens,
            "truncated_share": sums["truncated"] / tokens,
            "behaviour_kl": sums["kl"] / tokens,
            "behaviour_weight_mean": sums["weight"] / tokens,
            "grad_norm": float(norm),
            "lr": self._lr(),
            "micro_batches": float(len(micro)),
        }
        if cfg.kl_coef > 0 and cfg.kl_in == "loss":
            out_stats["kl_loss"] = sums["kl_loss"] / tokens
        if w > 0 and cfg.distill == "topk":
            out_stats["distill_loss"] = sums["distill_loss"] / tokens
        return out_stats

    def _micro_batches(self, chosen: list[int], rows: list) -> list[list[int]]:
        """Samples grouped by length, each group padded to at most the token budget."""
        order = sorted(chosen, key=lambda i: len(rows[i].prompt_ids) + len(rows[i].response_ids))
        out, current, longest = [], [], 0
        for i in order:
            length = len(rows[i].prompt_ids) + len(rows[i].response_ids)
            if current and max(longest, length) * (len(current) + 1) > self.cfg.micro_batch_tokens:
                out.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, length)
        if current:
            out.append(current)
        return out

    def _pack(self, part: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
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

    def _lr(self) -> float:
        if self.cfg.warmup_steps and self.steps < self.cfg.warmup_steps:
            return self.cfg.lr * (self.steps + 1) / self.cfg.warmup_steps
        return self.cfg.lr

    def _set_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()

    # -- weights out ------------------------------------------------------------

    def snapshot(self) -> tuple[torch.Tensor, list[ParamSpec], int]:
        """The current weights packed into one flat buffer (a copy)."""
        return pack(self.model.named_parameters(), self.specs, self.nbytes), self.specs, self.nbytes

    # -- checkpoints ---------------------------------------------------------------

    def save(self, folder: pathlib.Path, run_state: dict[str, Any]) -> None:
        """A Hugging Face model directory plus optimizer, RNG and run state."""
        tmp = folder.with_name(folder.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self.model.save_pretrained(tmp, safe_serialization=True)
        for name in os.listdir(self.model_path):
            if "token" in name or name in ("generation_config.json", "vocab.json", "merges.txt"):
                src = pathlib.Path(self.model_path) / name
                if src.is_file() and not (tmp / name).exists():
                    shutil.copy(src, tmp / name)
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "steps": self.steps,
                "rng": {
                    "torch": torch.get_rng_state(),
                    "numpy": np.random.get_state(),
                    "python": random.getstate(),
                },
            },
            tmp / TRAINER_STATE,
        )
        (tmp / RUN_STATE).write_text(json.dumps(run_state, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)

    def load_state(self, folder: pathlib.Path) -> dict[str, Any]:
        """Restore optimizer and RNG state saved by `save`; the run state."""
        state = torch.load(folder / TRAINER_STATE, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        return json.loads((folder / RUN_STATE).read_text())


def _column(rows: list, part: list[int], name: str) -> torch.Tensor:
    """A per-token column of the samples `part`, concatenated (float32, or int32 ids)."""
    return torch.cat([torch.from_numpy(np.ascontiguousarray(getattr(rows[i], name))) for i in part])


def _token_mean(rows: list, per_sample) -> float:
    """The mean over every token of the batch of a per-token quantity."""
    values = [per_sample(r) for r in rows if len(r.response_ids)]
    return float(np.concatenate(values).mean()) if values else 0.0


class TorchTrainerEngine:
    """`TorchEngine` behind the trainer service's interface: steps run in a
    worker thread, weights go out over a gloo group that trainer rank 0
    hosts, checkpoints land where the service says."""

    def __init__(self, cfg: TorchTrainer, ctx: EngineContext) -> None:
        config = ctx.config
        rollout = config.roles.rollout.engine
        self.engine = TorchEngine(
            cfg,
            config.policy_path,
            temperature=getattr(rollout, "temperature", 1.0),
            seed=config.run.seed,
        )
        self.checkpoint_every = cfg.checkpoint_every
        self.host = ctx.host
        self.port = free_port(self.host)
        self.group: GlooGroup | None = None
        self.snapshots: dict[int, torch.Tensor] = {}
        if config.run.resume:
            self.engine.load_state(pathlib.Path(config.run.resume))

    def offer(self) -> tuple[WeightTransfer, list[ParamSpec]]:
        return WeightsGloo(host=self.host, port=self.port, nbytes=self.engine.nbytes), self.engine.specs

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Weights are pushed when the controller says so: nothing to serve."""
        task_status.started()

    async def connect(self, transfer: WeightTransfer | None) -> None:
        """Host the weight group and wait until every receiver has joined."""
        if not isinstance(transfer, WeightsGloo):
            raise ValueError(f"the torch trainer sends weights over gloo; the controller asks for {transfer!r}")
        self.group = await trio.to_thread.run_sync(GlooGroup, transfer.host, transfer.port, 0, transfer.world_size)

    async def train(self, batch: SampleBatch) -> dict[str, float]:
        return await trio.to_thread.run_sync(self.engine.train, batch)

    async def publish(self, version: int) -> int:
        flat, _, nbytes = await trio.to_thread.run_sync(self.engine.snapshot)
        self.snapshots[version] = flat
        return nbytes

    def new_group(self, transfer: WeightTransfer) -> WeightTransfer:
        """The next generation of the group, on a port free now."""
        return msgspec.structs.replace(transfer, host=self.host, port=free_port(self.host), nbytes=self.engine.nbytes)

    async def send(self, version: int, transfer: WeightTransfer | None) -> None:
        """Broadcast the weights of `version` to the rollout replicas (joining
        `transfer`, a new generation of the group, first)."""
        if transfer is not None:
            self.group = None
            await self.connect(transfer)
        flat = self.snapshots[version]
        for old in [v for v in self.snapshots if v <= version]:
            del self.snapshots[old]
        group = self.group
        if group is not None:
            try:
                await trio.to_thread.run_sync(group.broadcast, flat)
            except Exception:
                # A receiver died mid-way. Let go of the group now: its
                # connections close, and the receivers still waiting in this
                # broadcast return (to join the next generation).
                if self.group is group:
                    self.group = None
                raise

    async def save(self, folder: pathlib.Path, run_state: dict[str, int]) -> bool:
        await trio.to_thread.run_sync(self.engine.save, folder, run_state)
        return True
