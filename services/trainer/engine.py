"""What the trainer service needs of an engine (`TrainerEngine`), and how an
engine is chosen from the config.

An engine gets an `EngineContext` (config, rank, clock, counters), never the
service. Each replica is one rank of the trainer: rank 0 deals every step's
batch into a share per rank, and every rank takes its part of the optimizer
step on its share, publishes the weights of each new version, sends them
when the controller says so, and saves checkpoints into folders the service
names.
"""

from __future__ import annotations

import pathlib
from typing import Protocol

import trio
from rlflow.protocol import Adapter, ParamSpec, SampleBatch, WeightTransfer
from rlflow.services.base import EngineContext

from rlflow.config import SimTrainer, TorchTrainer


class TrainerEngine(Protocol):
    """A policy being trained, and the way its weights leave."""

    checkpoint_every: int
    """Save a checkpoint every this many steps (0: only at the end)."""
    adapter: Adapter | None
    """The LoRA adapter its weight updates carry instead of the whole model (None: the whole model)."""

    def offer(self) -> tuple[WeightTransfer, list[ParamSpec]]:
        """How its weights are sent, and the layout of a collective transfer's buffer."""

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Whatever it serves until cancelled (a weight server); started before the hello."""

    async def connect(self, transfer: WeightTransfer | None) -> None:
        """Set up the weight transfer the controller's welcome describes."""

    async def deal(self, batch: SampleBatch) -> tuple[dict[str, float], list[SampleBatch]]:
        """Rank 0: the statistics of the whole of a step's `batch`, and its
        samples to train on split into a share per rank."""

    async def train(self, share: SampleBatch) -> dict[str, float]:
        """This rank's part of one optimizer step, on its `share` (every rank
        at once); the step's statistics (whole, at rank 0)."""

    async def publish(self, version: int) -> tuple[int, str]:
        """Make the current weights `version`, ready to send; their size in bytes, and
        their checksum (SPEC.md, *Checksums*; empty: not checked)."""

    def new_group(self, transfer: WeightTransfer) -> WeightTransfer:
        """Where it will host a new generation of a collective group (its port
        picked now; the group is made in `send`)."""

    async def send(self, version: int, transfer: WeightTransfer | None, *, broadcast: bool = True) -> None:
        """Send `version` to the replicas that load weights (hosting `transfer` first, if given);
        `broadcast` false: only gather it with the other ranks (a version no receiver waits for)."""

    async def save(self, folder: pathlib.Path, run_state: dict[str, int]) -> bool:
        """Write a checkpoint into `folder` (every rank at the same step); whether there was anything to write."""

    async def close(self) -> None:
        """Let go of what it holds (process groups) on the way out."""


async def make_engine(ctx: EngineContext) -> TrainerEngine:
    match ctx.config.roles.trainer.engine:
        case SimTrainer() as cfg:
            from rlflow.services.trainer.sim import SimTrainerEngine

            return SimTrainerEngine(cfg, ctx)
        case TorchTrainer() as cfg:
            from rlflow.services.trainer.torch_trainer import TorchTrainerEngine

            return await trio.to_thread.run_sync(TorchTrainerEngine, cfg, ctx)
    raise ValueError(f"unknown trainer engine {ctx.config.roles.trainer.engine!r}")
