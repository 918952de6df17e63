"""What the critic service needs of an engine (`CriticEngine`), and how an
engine is chosen from the config.

An engine is a value model and its optimizer, over the critic's ranks. Rank 0
drives: it asks for the values of a batch's response tokens and for one
optimizer step on a batch; every other rank follows (`follow`), taking its
part of each, until rank 0 closes. Checkpoints land in the folders the
service names; `version` counts optimizer steps, from the checkpoint a run
resumed from.
"""

from __future__ import annotations

import pathlib
from typing import Protocol

import numpy as np
import trio

from rlflow.services.critic.config import SimCritic, TorchCritic
from rlflow.protocol import SampleBatch
from rlflow.services.base import EngineContext


class CriticEngine(Protocol):
    version: int
    """Optimizer steps taken (those of the checkpoint resumed from included)."""

    async def values(self, batch: SampleBatch) -> np.ndarray:
        """Rank 0: float32 [T], the value before each response token of `batch`
        (NaN for the rows of failed samples)."""

    async def train(self, batch: SampleBatch) -> dict[str, float]:
        """Rank 0: one optimizer step on `batch` (its `values` and `returns`
        columns filled in); the step's statistics."""

    async def save(self, folder: pathlib.Path, run_state: dict[str, int]) -> None:
        """Rank 0: write a checkpoint into `folder` (every rank takes part)."""

    async def follow(self) -> None:
        """A rank above 0: take part in whatever rank 0 does, until it closes."""

    async def close(self) -> None:
        """Let go of what it holds (rank 0 first tells the others to stop)."""


async def make_engine(ctx: EngineContext) -> CriticEngine:
    match ctx.config.roles.critic.engine:
        case SimCritic() as cfg:
            from rlflow.services.critic.sim import SimCriticEngine

            return SimCriticEngine(cfg, ctx)
        case TorchCritic() as cfg:
            from rlflow.services.critic.torch_engine import TorchCriticEngine

            return await trio.to_thread.run_sync(TorchCriticEngine, cfg, ctx)
    raise ValueError(f"unknown critic engine {ctx.config.roles.critic.engine!r}")
