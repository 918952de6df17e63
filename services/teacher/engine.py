"""What the teacher service needs of an engine (`TeacherEngine`), and how an
engine is chosen from the config.

An engine scores every response token of a batch with a frozen model: the
log-probability of the sampled token and, if asked, the model's own top-k
tokens and their log-probabilities, at the rollout's sampling temperature.
A sample it cannot score is reported, never filled with made-up values.
"""

from __future__ import annotations

from typing import Protocol

from rlflow.services.teacher.config import ModelTeacher, SimTeacher
from rlflow.protocol import SampleBatch
from rlflow.services.base import EngineContext
from rlflow.services.teacher.scores import Scores

class TeacherEngine(Protocol):
    async def start(self) -> None:
        """Load the model (blocking work goes to a thread)."""

    async def score(self, batch: SampleBatch) -> Scores:
        """Score every response token of `batch`."""

    async def probe(self) -> list[float]:
        """The log-probabilities of the probe sequence's continuation (`PROBE_IDS`)."""


def make_engine(ctx: EngineContext) -> TeacherEngine:
    match ctx.config.roles.teacher.engine:
        case SimTeacher() as cfg:
            from rlflow.services.teacher.sim import SimTeacherEngine

            return SimTeacherEngine(cfg, ctx)
        case ModelTeacher(backend="torch") as cfg:
            from rlflow.services.teacher.torch_engine import TorchTeacherEngine

            return TorchTeacherEngine(cfg, ctx)
        case ModelTeacher(backend="vllm") as cfg:
            from rlflow.services.teacher.vllm_engine import VllmTeacherEngine

            return VllmTeacherEngine(cfg, ctx)
    raise ValueError(f"unknown teacher engine {ctx.config.roles.teacher.engine!r}")
