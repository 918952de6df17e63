"""The teacher service: adds a frozen model's log-probability of every
response token (for distillation or a KL penalty) and passes the batch on."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import trio

from rlflow.config import SimTeacher
from rlflow.protocol import SampleBatch, Stage, Tensor, stamp
from rlflow.services.base import StageService


class TeacherService(StageService):
    """Fills in `teacher_logprobs`."""

    def __init__(self, spec):
        super().__init__(spec)
        self.engine = spec.config.roles.teacher.engine
        self.rng = np.random.default_rng((spec.config.run.seed, spec.rank, 13))

    async def process(self, batch: SampleBatch) -> SampleBatch:
        match self.engine:
            case SimTeacher(s_per_token=s_per_token):
                if s_per_token > 0:
                    await trio.sleep(s_per_token * batch.n_tokens)
                noise = self.rng.normal(0.0, 0.1, batch.n_tokens).astype(np.float32)
                teacher = np.minimum(batch.logprobs.numpy() + noise, 0.0).astype(np.float32)
            case _:
                raise ValueError(f"unknown teacher engine {self.engine!r}")
        self.counters["tokens"] += batch.n_tokens
        out = msgspec.structs.replace(batch, teacher_logprobs=Tensor.from_numpy(teacher))
        return stamp(out, Stage.TEACHER_END, time.time())
