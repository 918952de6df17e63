"""The critic's torch engine: a Hugging Face model with a scalar value head,
sharded over the critic's ranks with FSDP2 as the trainer is (`rlflow.services.fsdp`).

The model is the Hugging Face token-classification class of the policy's
architecture with one label (the value head, a linear layer on the last
hidden state), so that any model the trainer loads has a critic, and a
critic's checkpoint is a Hugging Face directory like the policy's. Started
from the policy's weights, the head is new and small (its outputs are near
0); started from a critic's directory, it is that critic.

The value of response token t is read at the position whose hidden state
predicts it (the prompt and the tokens before it), as the policy's
log-probability is (see `rlflow.algo.values`). A step is one optimizer step
on a batch: samples packed into micro-batches of at most
`micro_batch_tokens` tokens, the clipped value loss as a mean over every
token of the batch, the gradients clipped, AdamW.

Rank 0 drives its ranks over their own process group: it broadcasts each
piece of work (the batch as wire frames, and what to do with it); every rank
deals the batch the same way (`rlflow.algo.balance.deal`, by tokens) and
takes its share, in lock step; values come back to rank 0 by a gather. The
group's timeout is long: a critic may wait a long while for its next batch,
and a rank that dies is the launcher's to report.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np
import torch
import trio

from rlflow.algo.balance import deal, micro_batches
from rlflow.algo.values import own_count, own_tokens, value_loss
from rlflow.services.critic.config import TorchCritic
from rlflow.protocol import Codec, SampleBatch, samples
from rlflow.rundir import TRAINER_OPTIMIZER, beside
from rlflow.services.base import EngineContext
from rlflow.services.fsdp import (
    Sharded, Solo, autocast, bf16_passes, checkpoint_begin, checkpoint_end, rendezvous, restore_rng,
)

#: Beside a critic checkpoint's model: the critic's RNG and step.
CRITIC_STATE = "critic_state.pt"
#: Sums a step's passes add to, over every rank (divided by its tokens at the end).
SUMS = ("loss", "clipped", "error")
#: How long the critic's ranks wait on each other (a week): rank 0 may wait
#: long for its next batch, and the others wait for rank 0 meanwhile.
GROUP_TIMEOUT_S = 7 * 24 * 3600.0


def is_critic(path: str | os.PathLike) -> bool:
    """Whether the Hugging Face directory at `path` holds a value model (its
    token-classification class), rather than a policy whose head is to be new."""
    try:
        architectures = json.loads((pathlib.Path(path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(name.endswith("ForTokenClassification") for name in architectures)


def value_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The linear layer that makes the value (``score`` in most classes)."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    raise ValueError(f"{type(model).__name__} has no value head (a linear layer named score or classifier)")


class CriticModel:
    """Holds the value model (this rank's shards of it) and its optimizer."""

    def __init__(self, cfg: TorchCritic, model_path: str, *, seed: int = 0, ranks: Solo | None = None):
        from transformers import AutoConfig, AutoModelForTokenClassification

        torch.manual_seed(seed)
        threads = int(os.environ.get("RLFLOW_NUM_THREADS", "0") or 0)
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.model_path = model_path
        self.ranks = ranks or Solo()
        fresh = not is_critic(model_path)
        # No dropout: every rank must compute what one rank would, and values are read in train mode.
        config = AutoConfig.from_pretrained(model_path, num_labels=1)
        config.classifier_dropout = 0.0
        if fresh:
            # No bias (as OpenRLHF's value head): a linear layer with one on the 3-D hidden states returns a
            # view, which FSDP2 warns of at every forward pass.
            config.token_classification_bias = False
        model = AutoModelForTokenClassification.from_pretrained(model_path, config=config,
                                                                dtype=getattr(torch, cfg.dtype))
        if fresh:
            head = value_head(model)
            with torch.no_grad():  # values start near 0, and the backbone gets a gradient from the first step
                head.weight.normal_(0.0, 1.0 / (model.config.hidden_size + 1))
                if head.bias is not None:
                    head.bias.zero_()
        self.model = self.ranks.shard(model)
        self.model.train()
        #: bf16 forward and backward passes on a CPU (`mixed_precision`).
        self.mixed = bf16_passes(cfg.mixed_precision, self.ranks.device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )
        self.steps = 0

    # -- values -------------------------------------------------------------------

    def values(self, batch: SampleBatch) -> np.ndarray | None:
        """Every rank: the values of its share of `batch`; rank 0 gets float32 [T]
        for the whole batch (NaN for failed samples), the others None."""
        rows = list(samples(batch))
        failed = {f.index for f in batch.failures}
        todo = [r for r in rows if r.row not in failed and len(r.response_ids)]
        mine = self._share(todo)
        micro = micro_batches([_width(r) for r in mine], self.cfg.micro_batch_tokens)
        passes = self.ranks.max(len(micro))
        local: dict[int, np.ndarray] = {}
        with torch.no_grad():
            for i in range(passes):
                if i >= len(micro):
                    self._idle_pass()
                    continue
                part = [mine[j] for j in micro[i]]
                flat = self._forward(part).float().cpu().numpy()
                at = 0
                for r in part:
                    local[r.row] = flat[at : at + len(r.response_ids)]
                    at += len(r.response_ids)
        gathered = self.ranks.gather_object(local)
        if gathered is None:
            return None
        out = np.full(batch.n_tokens, np.nan, np.float32)
        offsets = batch.response_offsets.numpy()
        for part in gathered:
            for row, values in part.items():
                out[offsets[row] : offsets[row + 1]] = values
        return out

    # -- one step -------------------------------------------------------------------

    def step(self, batch: SampleBatch) -> dict[str, float]:
        """Every rank: its part of one optimizer step on `batch` (whose `values`
        are those the returns were computed with); the step's statistics."""
        rows = [r for r in samples(batch) if len(r.response_ids)
                and np.isfinite(r.values).all() and np.isfinite(r.returns).all()]
        mine = self._share(rows)
        micro = micro_batches([_width(r) for r in mine], self.cfg.micro_batch_tokens)
        passes = self.ranks.max(len(micro))
        (tokens,) = self.ranks.sum([float(sum(own_count(r) for r in mine))])
        if tokens == 0:
            self.steps += 1
            return {"value_loss": 0.0, "grad_norm": 0.0, "tokens": 0.0}
        sums = dict.fromkeys(SUMS, 0.0)
        for i in range(passes):
            if i < len(micro):
                self._pass([mine[j] for j in micro[i]], tokens, sums)
            else:
                self._idle_pass(backward=True)
        sums = dict(zip(SUMS, self.ranks.sum(list(sums.values()))))
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {
            "value_loss": sums["loss"] / tokens,
            "value_error": sums["error"] / tokens,
            "value_clipped_share": sums["clipped"] / tokens,
            "grad_norm": float(norm),
            "tokens": tokens,
            "micro_batches": float(passes),
        }

    def _pass(self, part: list, tokens: float, sums: dict[str, float]) -> None:
        """Forward and backward over one micro-batch, its loss scaled by 1 / `tokens`."""
        device = self.ranks.device
        new = self._forward(part).float()
        old = torch.from_numpy(np.concatenate([r.values for r in part])).to(device)
        returns = torch.from_numpy(np.concatenate([r.returns for r in part])).to(device)
        if any(r.loss_mask is not None for r in part):  # an episode's observations: not the policy's states
            keep = torch.from_numpy(own_tokens(part)).to(device)
            new, old, returns = new[keep], old[keep], returns[keep]
        loss, clipped = value_loss(new, old, returns, self.cfg.value_clip)
        (loss / tokens).backward()
        sums["loss"] += loss.item()
        sums["clipped"] += float(clipped)
        sums["error"] += float(0.5 * ((new.detach() - returns) ** 2).sum())

    def _forward(self, part: list) -> torch.Tensor:
        """The value before each response token of `part`, concatenated."""
        device = self.ranks.device
        width = max(_width(r) for r in part)
        ids = torch.zeros((len(part), width), dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        rows, cols = [], []
        for row, sample in enumerate(part):
            seq = np.concatenate([sample.prompt_ids, sample.response_ids]).astype(np.int64)
            ids[row, : len(seq)] = torch.from_numpy(seq)
            mask[row, : len(seq)] = 1
            start = len(sample.prompt_ids)
            positions = torch.arange(start - 1, start - 1 + len(sample.response_ids))
            rows.append(torch.full_like(positions, row))
            cols.append(positions)
        with autocast(self.mixed):
            out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        return out[torch.cat(rows).to(device), torch.cat(cols).to(device), 0].float()

    def _idle_pass(self, backward: bool = False) -> None:
        """A pass of nothing, for a rank with fewer micro-batches than another:
        its gathers and scatters pair with theirs; its gradient is zero."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.ranks.device)
        out = self.model(input_ids=ids).logits.sum() * 0.0
        if backward:
            out.backward()

    def _share(self, rows: list) -> list:
        """This rank's rows of `rows`, dealt by tokens (every rank deals alike)."""
        if self.ranks.world == 1:
            return rows
        part = deal([_width(r) for r in rows], self.ranks.world)[self.ranks.rank]
        return [rows[i] for i in part]

    # -- checkpoints ------------------------------------------------------------------

    def save(self, folder: pathlib.Path, run_state: dict[str, Any]) -> None:
        """A Hugging Face directory of the value model, plus optimizer, RNG and run state (every rank)."""
        tmp = checkpoint_begin(folder, self.ranks)
        self.ranks.save_optimizer(self.model, self.optimizer, tmp / TRAINER_OPTIMIZER)
        weights = self.ranks.full_state(self.model)
        if not self.ranks.lead:
            return
        self.model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        del weights
        checkpoint_end(tmp, folder, model_path=self.model_path, state_file=CRITIC_STATE, steps=self.steps,
                       run_state=run_state)

    def load_state(self, folder: pathlib.Path) -> None:
        """Restore the optimizer, RNG and step saved by `save` (on any number of
        ranks; the weights are the folder's model, loaded at start)."""
        state = torch.load(folder / CRITIC_STATE, weights_only=False)
        self.ranks.load_optimizer(self.model, self.optimizer, folder / TRAINER_OPTIMIZER)
        self.steps = state["steps"]
        restore_rng(state)


def _width(sample: Any) -> int:
    return len(sample.prompt_ids) + len(sample.response_ids)


class TorchCriticEngine:
    """`CriticModel` behind the critic service's interface: one rank of the
    critic; each piece of work runs in a worker thread, rank 0's broadcast
    first (see the module docstring)."""

    def __init__(self, cfg: TorchCritic, ctx: EngineContext):
        config = ctx.config
        self.ctx = ctx
        self.ranks = Sharded(ctx.rank, ctx.replicas, *rendezvous(ctx.replicas), timeout_s=GROUP_TIMEOUT_S)
        resume = pathlib.Path(config.run.resume) if config.run.resume else None
        folder = beside(resume, "critic") if resume is not None else None
        if folder is not None and not (folder / CRITIC_STATE).is_file():
            raise FileNotFoundError(f"{folder} holds no critic checkpoint to resume from")
        self.model = CriticModel(cfg, str(folder or cfg.model), seed=config.run.seed, ranks=self.ranks)
        if folder is not None:
            self.model.load_state(folder)
        self.codec = Codec()

    @property
    def version(self) -> int:
        return self.model.steps

    async def values(self, batch: SampleBatch) -> np.ndarray:
        return await self._lead("values", batch)

    async def train(self, batch: SampleBatch) -> dict[str, float]:
        return await self._lead("step", batch)

    async def save(self, folder: pathlib.Path, run_state: dict[str, int]) -> None:
        await self._lead("save", (str(folder), run_state))

    async def _lead(self, what: str, arg: Any) -> Any:
        """Rank 0: tell every rank what to do, and do it with them."""
        payload = [bytes(f) for f in self.codec.encode(arg)] if isinstance(arg, SampleBatch) else arg
        return await trio.to_thread.run_sync(self._do, what, payload)

    def _do(self, what: str, payload: Any) -> Any:
        """Rank 0: one piece of work, on every rank in step."""
        return self._work(*self.ranks.broadcast_object((what, payload)))

    async def follow(self) -> None:
        """A rank above 0: work with rank 0 until it says stop (a wait abandoned
        if cancelled: the thread is in a collective)."""
        clock = self.ctx.clock
        while True:
            with clock.state("starved"):
                what, payload = await trio.to_thread.run_sync(self.ranks.broadcast_object, None,
                                                              abandon_on_cancel=True)
            if what == "stop":
                return
            with clock.state("busy" if what != "save" else "loading"):
                await trio.to_thread.run_sync(self._work, what, payload, abandon_on_cancel=True)

    def _work(self, what: str, payload: Any) -> Any:
        if what == "stop":
            return None
        if what == "save":
            folder, run_state = payload
            return self.model.save(pathlib.Path(folder), run_state)
        batch = self.codec.decode(payload)
        return self.model.values(batch) if what == "values" else self.model.step(batch)

    async def close(self) -> None:
        if self.ranks.lead and self.ranks.world > 1:
            with trio.move_on_after(30):
                await trio.to_thread.run_sync(self.ranks.broadcast_object, ("stop", None), abandon_on_cancel=True)
        await trio.to_thread.run_sync(self.ranks.close, abandon_on_cancel=True)
