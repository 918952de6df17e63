"""The teacher as vLLM's prompt log-probabilities (the `vllm` backend).

Each sample (prompt and response) is one request of one generated token with
`prompt_logprobs = top_k`; vLLM returns, at every position, the
log-probability of the token there and its k most likely tokens. Prompt
tokens skip vLLM's sampling processors, so these are at temperature 1: the
backend refuses another temperature. On CPU it was measured slower than the
torch backend (see the README), which is the default.
"""

from __future__ import annotations

import numpy as np
import trio

from rlflow.config import VllmRollout
from rlflow.services.teacher.config import ModelTeacher
from rlflow.protocol import SampleBatch, samples
from rlflow.services.base import EngineContext
from rlflow.services.vllm_client import VllmBackend
from rlflow.services.teacher.scores import PROBE_IDS, PROBE_PROMPT, Scores


class VllmTeacherEngine:
    def __init__(self, cfg: ModelTeacher, ctx: EngineContext):
        rollout_t = getattr(ctx.config.roles.rollout.engine, "temperature", 1.0)
        temperature = cfg.temperature if cfg.temperature is not None else rollout_t
        if temperature != 1.0:
            raise ValueError(
                f"the vllm teacher backend scores at temperature 1 (vLLM's prompt log-probabilities skip its "
                f"sampling processors), the rollout samples at {temperature:g}: use backend = 'torch'"
            )
        self.cfg = cfg
        engine = VllmRollout(max_num_seqs=64, max_tokens=1, dtype=cfg.dtype, kv_cache_bytes=cfg.kv_cache_bytes)
        # vLLM returns at most 20 log-probabilities per position unless told more.
        self.backend = VllmBackend(engine, cfg.model, ctx.config.run.seed + ctx.rank, max_logprobs=max(20, cfg.top_k))

    async def start(self) -> None:
        await trio.to_thread.run_sync(self.backend.start_blocking)

    async def score(self, batch: SampleBatch) -> Scores:
        rows = list(samples(batch))
        k = self.cfg.top_k
        offsets = np.concatenate([[0], np.cumsum([len(r.response_ids) for r in rows])]).astype(np.int64)
        scores = Scores(
            np.full(int(offsets[-1]), np.nan, np.float32),
            np.zeros((int(offsets[-1]), k), np.int32) if k else None,
            np.full((int(offsets[-1]), k), np.nan, np.float32) if k else None,
        )

        async def one(i: int) -> None:
            row = rows[i]
            if not len(row.response_ids):
                return
            ids = [*row.prompt_ids.tolist(), *row.response_ids.tolist()]
            try:
                positions = (await self.backend.prompt_logprobs(ids, k))[len(row.prompt_ids):]
            except Exception as exc:  # per sample: failed in-band (e.g. longer than the model's context)
                scores.failed[i] = ("error", f"{type(exc).__name__}: {exc}"[:500])
                return
            for j, (token, entry) in enumerate(zip(row.response_ids.tolist(), positions)):
                at = offsets[i] + j
                scores.logprobs[at] = entry[token].logprob
                if k:
                    top = sorted((lp.rank, token_id, lp.logprob) for token_id, lp in entry.items() if lp.rank <= k)[:k]
                    scores.topk_ids[at] = [t for _, t, _ in top]
                    scores.topk_logprobs[at] = [v for _, _, v in top]

        async with trio.open_nursery() as nursery:
            for i in range(len(rows)):
                nursery.start_soon(one, i)
        return scores

    async def probe(self) -> list[float]:
        positions = await self.backend.prompt_logprobs(PROBE_IDS, 0)
        return [positions[j][PROBE_IDS[j]].logprob for j in range(PROBE_PROMPT, len(PROBE_IDS))]
