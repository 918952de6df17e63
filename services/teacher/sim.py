"""The simulated teacher: a fixed time per scored token and made-up
log-probabilities near the behaviour policy's (for scale runs and the bench
only; a real run's teacher is `torch_engine` or `vllm_engine`)."""

from __future__ import annotations

import numpy as np
import trio

from rlflow.services.teacher.config import SimTeacher
from rlflow.protocol import SampleBatch
from rlflow.services.base import EngineContext
from rlflow.services.teacher.scores import PROBE_IDS, PROBE_PROMPT, Scores


class SimTeacherEngine:
    def __init__(self, cfg: SimTeacher, ctx: EngineContext):
        self.cfg = cfg
        self.rng = np.random.default_rng((ctx.config.run.seed, ctx.rank, 13))

    async def start(self) -> None:
        """Nothing to load."""

    async def score(self, batch: SampleBatch) -> Scores:
        if self.cfg.s_per_token > 0:
            await trio.sleep(self.cfg.s_per_token * batch.n_tokens)
        noise = self.rng.normal(0.0, 0.1, batch.n_tokens).astype(np.float32)
        return Scores(np.minimum(batch.logprobs.numpy() + noise, 0.0).astype(np.float32))

    async def probe(self) -> list[float]:
        return [0.0] * (len(PROBE_IDS) - PROBE_PROMPT)
