"""The simulated trainer engine: a product feature for scale runs and the bench.

It trains for `s_per_token` per token of its share (ranks share a step's
tokens as the torch trainer's do), and `inline_critic_s_per_token` more where
a value model's forward pass and step are modelled in its process (a one-worker
layout); its weights are `weights_bytes` of fixed
random bytes, in tensors of at most 4 MiB, that really cross the wire: the
rollout fetches them from rank 0's weight server.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import numpy as np
import trio
from rlflow.protocol import (
    ParamSpec,
    SampleBatch,
    Tensor,
    WeightsPayload,
    WeightsZmq,
    WeightTransfer,
    payload_checksum,
    take,
)
from rlflow.services.base import EngineContext
from rlflow.services.zmq_weights import WeightServer

from rlflow.algo.balance import deal
from rlflow.config import SimTrainer
from rlflow.rundir import RUN_STATE

#: Largest tensor of a simulated weight payload (a model's layer).
SIM_TENSOR_BYTES = 4 << 20


class SimTrainerEngine:
    """See the module docstring."""

    def __init__(self, cfg: SimTrainer, ctx: EngineContext):
        self.cfg = cfg
        self.checkpoint_every = cfg.checkpoint_every
        self.ctx = ctx
        rng = np.random.default_rng((ctx.config.run.seed, 17))
        data = rng.integers(0, 256, cfg.weights_bytes, dtype=np.uint8)
        chunks = range(0, cfg.weights_bytes, SIM_TENSOR_BYTES)
        self.names = [f"layers.{i}.weight" for i in range(len(chunks))]
        self.tensors = [Tensor.from_numpy(data[a : a + SIM_TENSOR_BYTES]) for a in chunks]
        #: The same bytes at every version, so one checksum.
        self.checksum = payload_checksum(self.names, self.tensors)
        self.adapter = None
        self.server = WeightServer(ctx)

    def offer(self) -> tuple[WeightTransfer, list[ParamSpec]]:
        return WeightsZmq(address=self.server.address), []

    async def connect(self, transfer: WeightTransfer | None) -> None:
        """The rollout pulls weights from the server: nothing to join."""

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Answer each weight request with the newest version (once it is there)."""
        await self.server.serve(task_status=task_status)

    async def deal(self, batch: SampleBatch) -> tuple[dict[str, float], list[SampleBatch]]:
        lengths = np.diff(batch.response_offsets.numpy()).tolist()
        return {}, [take(batch, part) for part in deal(lengths, self.ctx.replicas)]

    async def train(self, share: SampleBatch) -> dict[str, float]:
        seconds = (self.cfg.step_overhead_s
                   + (self.cfg.s_per_token + self.cfg.inline_critic_s_per_token) * share.n_tokens)
        if seconds > 0:
            await trio.sleep(seconds)
        return {"loss": 0.0}

    async def publish(self, version: int) -> tuple[int, str]:
        self.server.publish(WeightsPayload(version=version, names=self.names, tensors=self.tensors))
        return sum(t.nbytes for t in self.tensors), self.checksum

    def new_group(self, transfer: WeightTransfer) -> WeightTransfer:
        """No group: the weights are served."""
        return transfer

    async def send(self, version: int, transfer: WeightTransfer | None, *, broadcast: bool = True) -> None:
        """Pulled, not pushed: nothing to do."""

    async def save(self, folder: pathlib.Path, run_state: dict[str, int]) -> bool:
        """A checkpoint of no weights (every `checkpoint_every` steps, by rank 0):
        the run state, written whole or not at all, so that a simulated run resumes."""
        if not self.cfg.checkpoint_every or self.ctx.rank != 0:
            return False
        tmp = folder.with_name(folder.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / RUN_STATE).write_text(json.dumps(run_state))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        return True

    async def close(self) -> None:
        """Nothing held beyond its sockets."""
