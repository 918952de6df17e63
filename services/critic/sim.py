"""The simulated critic engine, for scale runs and the bench.

Its forward pass and its step take `forward_s_per_token` and
`step_s_per_token` per response token, on one rank (lower them to model
more); its values are 0, so the advantages it attaches are the discounted
rewards. A checkpoint holds its version alone.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import numpy as np
import trio

from rlflow.services.critic.config import SimCritic
from rlflow.protocol import SampleBatch
from rlflow.rundir import RUN_STATE, beside
from rlflow.services.base import EngineContext


class SimCriticEngine:
    """See the module docstring."""

    def __init__(self, cfg: SimCritic, ctx: EngineContext):
        self.cfg = cfg
        self.ctx = ctx
        self.version = 0
        resume = ctx.config.run.resume
        if resume:
            folder = beside(pathlib.Path(resume), "critic")
            if not (folder / RUN_STATE).is_file():
                raise FileNotFoundError(f"{folder} holds no critic checkpoint to resume from")
            self.version = int(json.loads((folder / RUN_STATE).read_text())["version"])

    async def values(self, batch: SampleBatch) -> np.ndarray:
        await self._spend(self.cfg.forward_s_per_token * batch.n_tokens)
        return np.zeros(batch.n_tokens, np.float32)

    async def train(self, batch: SampleBatch) -> dict[str, float]:
        await self._spend(self.cfg.step_overhead_s + self.cfg.step_s_per_token * batch.n_tokens)
        self.version += 1
        return {"value_loss": 0.0}

    async def _spend(self, seconds: float) -> None:
        if seconds > 0:
            await trio.sleep(seconds)

    async def save(self, folder: pathlib.Path, run_state: dict[str, int]) -> None:
        tmp = folder.with_name(folder.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / RUN_STATE).write_text(json.dumps(run_state))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)

    async def follow(self) -> None:
        """One rank: there is no other to follow."""

    async def close(self) -> None:
        """Nothing held."""
