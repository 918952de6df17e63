"""The teacher as a torch forward pass of a frozen Hugging Face model.

Samples are packed into forward passes of at most `batch_tokens` padded
tokens, shortest first; at each response position the logits, divided by the
sampling temperature, give the sampled token's log-probability
(``logit - logsumexp``) and, with `top_k`, the k largest and their ids. No
vocabulary-sized tensor is kept beyond the logits of one pass; only T
values (and T x k) leave the engine.

A sample longer than the model's context is reported as failed; a pass that
raises fails the samples in it, and the engine goes on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import trio

from rlflow.services.teacher.config import ModelTeacher
from rlflow.protocol import SampleBatch, samples
from rlflow.services.base import EngineContext
from rlflow.services.teacher.scores import PROBE_IDS, PROBE_PROMPT, Scores


#: Response positions whose vocabulary-sized logits are held at once.
LOGIT_ROWS = 1024


def load_teacher(path: str, dtype: str = "float32"):
    """The frozen model at `path`, for scoring."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    model.requires_grad_(False)
    return model


def score_sequences(
    model,
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    *,
    temperature: float,
    top_k: int,
    batch_tokens: int,
) -> Scores:
    """Log-probabilities of each response token given its prompt (see the module)."""
    max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    lengths = [len(r) for r in responses]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    logprobs = np.full(total, np.nan, np.float32)
    topk_ids = np.zeros((total, top_k), np.int32) if top_k else None
    topk_lps = np.full((total, top_k), np.nan, np.float32) if top_k else None
    failed: dict[int, tuple[str, str]] = {}
    todo = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) + len(r) > max_positions:
            failed[i] = ("too_long", f"{len(p) + len(r)} tokens; the teacher's context holds {max_positions}")
        elif len(r):
            todo.append(i)
    todo.sort(key=lambda i: len(prompts[i]) + len(responses[i]))
    passes, current, widest = [], [], 0
    for i in todo:
        width = len(prompts[i]) + len(responses[i])
        if current and max(widest, width) * (len(current) + 1) > batch_tokens:
            passes.append(current)
            current, widest = [], 0
        current.append(i)
        widest = max(widest, width)
    if current:
        passes.append(current)
    t = temperature if temperature > 0 else 1.0
    with torch.inference_mode():
        for part in passes:
            try:
                _score_pass(model, part, prompts, responses, offsets, t, top_k, logprobs, topk_ids, topk_lps)
            except Exception as exc:  # per pass: its samples fail in-band, the engine goes on
                for i in part:
                    failed[i] = ("error", f"{type(exc).__name__}: {exc}"[:500])
                    logprobs[offsets[i] : offsets[i + 1]] = np.nan
    return Scores(logprobs, topk_ids, topk_lps, failed)


def _score_pass(model, part, prompts, responses, offsets, t, top_k, logprobs, topk_ids, topk_lps) -> None:
    width = max(len(prompts[i]) + len(responses[i]) for i in part)
    ids = torch.zeros((len(part), width), dtype=torch.long)
    mask = torch.zeros((len(part), width), dtype=torch.long)
    rows, cols, targets = [], [], []
    for row, i in enumerate(part):
        seq = np.concatenate([prompts[i], responses[i]]).astype(np.int64)
        ids[row, : len(seq)] = torch.from_numpy(seq)
        mask[row, : len(seq)] = 1
        start = len(prompts[i])
        rows.append(torch.full((len(responses[i]),), row))
        cols.append(torch.arange(start - 1, start - 1 + len(responses[i])))
        targets.append(torch.from_numpy(responses[i].astype(np.int64)))
    # The vocabulary-sized logits only at response positions, and only
    # LOGIT_ROWS of them at a time: memory is bounded by that, not by the pass.
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state[torch.cat(rows), torch.cat(cols)]
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    target = torch.cat(targets)
    sampled = np.empty(len(target), np.float32)
    top_values = np.empty((len(target), top_k), np.float32)
    top_indices = np.empty((len(target), top_k), np.int32)
    for a in range(0, len(target), LOGIT_ROWS):
        b = min(a + LOGIT_ROWS, len(target))
        logits = head(hidden[a:b]).float()
        if cap:
            logits = cap * torch.tanh(logits / cap)
        logits = logits / t
        lse = torch.logsumexp(logits, dim=-1)
        sampled[a:b] = (logits.gather(-1, target[a:b, None]).squeeze(-1) - lse).numpy()
        if top_k:
            values, indices = torch.topk(logits, top_k, dim=-1)
            top_values[a:b] = (values - lse[:, None]).numpy()
            top_indices[a:b] = indices.to(torch.int32).numpy()
    at = 0
    for i in part:
        n = len(responses[i])
        a = offsets[i]
        logprobs[a : a + n] = sampled[at : at + n]
        if top_k:
            topk_ids[a : a + n] = top_indices[at : at + n]
            topk_lps[a : a + n] = top_values[at : at + n]
        at += n


class TorchTeacherEngine:
    """A frozen model scored with torch in a worker thread."""

    def __init__(self, cfg: ModelTeacher, ctx: EngineContext):
        self.cfg = cfg
        self.ctx = ctx
        rollout_t = getattr(ctx.config.roles.rollout.engine, "temperature", 1.0)
        self.temperature = cfg.temperature if cfg.temperature is not None else rollout_t
        self.model = None

    async def start(self) -> None:
        threads = int(os.environ.get("RLFLOW_NUM_THREADS", "0") or 0)
        if threads:
            torch.set_num_threads(threads)
        self.model = await trio.to_thread.run_sync(load_teacher, self.cfg.model, self.cfg.dtype)

    async def score(self, batch: SampleBatch) -> Scores:
        rows = list(samples(batch))
        return await trio.to_thread.run_sync(
            lambda: score_sequences(
                self.model,
                [r.prompt_ids for r in rows],
                [r.response_ids for r in rows],
                temperature=self.temperature,
                top_k=self.cfg.top_k,
                batch_tokens=self.cfg.batch_tokens,
            )
        )

    async def probe(self) -> list[float]:
        ids = np.asarray(PROBE_IDS, np.int32)
        scores = await trio.to_thread.run_sync(
            lambda: score_sequences(self.model, [ids[:PROBE_PROMPT]], [ids[PROBE_PROMPT:]],
                                    temperature=self.temperature, top_k=0, batch_tokens=len(ids))
        )
        return scores.logprobs.tolist()
