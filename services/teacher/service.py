"""The teacher service: adds a frozen model's log-probability of every
response token (and, if asked, its top-k tokens) to each batch as it streams
past, for on-policy distillation or a KL penalty, and passes it on.

A sample the engine cannot score (an error, a sequence longer than the
teacher's context) is marked failed in-band, as a failed reward is; no
value is made up, and the service goes on. Each replica scores a fixed probe
sequence at start and reports it in its hello, so that the controller can
refuse replicas that disagree.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np

from rlflow.protocol import SampleBatch, SampleFailure, Stage, Tensor, stamp
from rlflow.services.base import StageService
from rlflow.services.teacher.engine import TeacherEngine, make_engine


class TeacherService(StageService):
    """Fills in `teacher_logprobs` (and the top-k columns)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.engine: TeacherEngine = make_engine(self.context())
        self._probe: list[float] = []

    async def prepare(self) -> None:
        started = time.monotonic()
        await self.engine.start()
        self._probe = await self.engine.probe()
        self.say("%s ready in %.1f s", type(self.engine).__name__, time.monotonic() - started)

    def hello_fields(self) -> dict[str, Any]:
        return {"probe": list(self._probe)}

    async def process(self, batch: SampleBatch) -> SampleBatch:
        failed_before = {f.index for f in batch.failures}
        scores = await self.engine.score(batch)
        failures = [
            SampleFailure(index=row, stage=Stage.TEACHER_END, kind=kind, message=message)
            for row, (kind, message) in sorted(scores.failed.items())
            if row not in failed_before
        ]
        self.counters["tokens"] += batch.n_tokens
        self.counters["failed_samples"] += len(failures)
        out = msgspec.structs.replace(
            batch,
            teacher_logprobs=Tensor.from_numpy(np.asarray(scores.logprobs, np.float32)),
            failures=[*batch.failures, *failures],
            **(
                {}
                if scores.topk_ids is None
                else {
                    "teacher_topk_ids": Tensor.from_numpy(scores.topk_ids),
                    "teacher_topk_logprobs": Tensor.from_numpy(scores.topk_logprobs),
                }
            ),
        )
        return stamp(out, Stage.TEACHER_END, time.time())
