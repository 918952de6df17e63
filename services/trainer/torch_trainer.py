"""The torch trainer behind the trainer service's interface
(`engine.TrainerEngine`): `TorchTrainerEngine` is one rank of the trainer,
a `torch_engine.TorchEngine` whose steps run in a worker thread.

Weights leave after each step as the engine's snapshot of the version
(`trained`); rank 0 hosts the weight group every rollout replica joins and
sends each version when the controller says so: over gloo on the CPU
(`WeightsGloo`, the flat buffer piece by piece), or on CUDA over vLLM's
packed NCCL broadcast (`WeightsNccl`, the gathered parameters one by one).
A LoRA adapter over ZeroMQ (`Lora.transfer = "zmq"`) is served by rank 0's
weight server from the moment it is published instead: no group, nothing
to send. A failed send lets go of the group; the controller may move the
version again through a new generation of it.
"""

from __future__ import annotations

import functools
import pathlib
import socket
from collections.abc import Callable, Iterator

import msgspec
import torch
import trio
from rlflow.protocol import (
    Adapter, ParamSpec, SampleBatch, Tensor, WeightsGloo, WeightsNccl, WeightsPayload, WeightsZmq, WeightTransfer,
)
from rlflow.services.base import EngineContext
from rlflow.services.fsdp import Sharded, rendezvous
from rlflow.services.trainer.lora import adapter_offer
from rlflow.services.trainer.torch_engine import TorchEngine
from rlflow.services.weights import GlooGroup, NcclGroup
from rlflow.services.zmq_weights import WeightServer

from rlflow.config import TorchTrainer
from rlflow.data.net import listener


class TorchTrainerEngine:
    """`TorchEngine` behind the trainer service's interface: one rank of the
    trainer, its steps in a worker thread; rank 0 hosts a gloo group with
    every rollout replica and broadcasts the weights there; checkpoints
    land where the service says."""

    def __init__(self, cfg: TorchTrainer, ctx: EngineContext) -> None:
        config = ctx.config
        rollout = config.roles.rollout.engine
        self.replicas = ctx.replicas
        self.ranks = Sharded(ctx.rank, ctx.replicas, *rendezvous(ctx.replicas),
                             timeout_s=config.cluster.handshake_timeout_s + 1800.0)
        self.engine = TorchEngine(
            cfg,
            config.policy_path,
            temperature=getattr(rollout, "temperature", 1.0),
            seed=config.run.seed,
            ranks=self.ranks,
            total_steps=config.run.steps,
            adapter=config.adapter_path,
            max_tokens=getattr(rollout, "max_tokens", 0),
            deterministic=config.run.deterministic,
        )
        #: With LoRA, the adapter its weight updates carry (its `Hello.adapter`).
        self.adapter: Adapter | None = adapter_offer(cfg.lora, config.run.max_staleness) if cfg.lora else None
        self.checkpoint_every = cfg.checkpoint_every
        self.cluster = config.cluster
        self.host = ctx.host
        #: Where rank 0 will host the weight group it offers: listening since it was offered, so that
        #: no other process takes the port while the receivers start (`compat.master_store`).
        self._listener: socket.socket | None = None
        self.ranks_per_receiver = getattr(rollout, "tensor_parallel_size", 1)
        self.group: GlooGroup | NcclGroup | None = None
        #: An adapter over ZeroMQ (`Lora.transfer`): the replicas fetch it from rank 0's weight server; no
        #: group to host, nothing to send.
        self.pulled = cfg.lora is not None and cfg.lora.transfer == "zmq"
        self.server = WeightServer(ctx) if self.pulled and self.ranks.lead else None
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self._published: dict[int, trio.Event] = {}
        if config.run.resume:
            self.engine.load_state(pathlib.Path(config.run.resume))

    def offer(self) -> tuple[WeightTransfer, list[ParamSpec]]:
        engine = self.engine
        if self.server is not None:
            return WeightsZmq(address=self.server.address), engine.specs
        if self._listener is None:
            self._listener = listener(self.host)
        return weight_offer(self.ranks.device.type, self.host, self._listener.getsockname()[1], engine.nbytes,
                            engine.cfg.bucket_bytes, self.ranks_per_receiver), engine.specs

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """An adapter over ZeroMQ: the weight server; else weights are pushed when the controller
        says so: nothing to serve."""
        if self.server is not None:
            await self.server.serve(task_status=task_status)
        else:
            task_status.started()

    async def connect(self, transfer: WeightTransfer | None, *, first: bool = True) -> None:
        """Host the weight group and wait until every receiver has joined (rank
        0; the other ranks only help gather): the first group as long as the
        services may take to start, a later generation `cluster.weight_timeout_s`."""
        if (transfer is None and not self.ranks.lead) or self.pulled:
            return  # over ZeroMQ there is no group
        offered = WeightsNccl if self.ranks.device.type == "cuda" else WeightsGloo
        if not isinstance(transfer, offered):
            raise ValueError(f"the torch trainer on {self.ranks.device.type} sends weights as {offered.__name__}; "
                             f"the controller asks for {transfer!r}")
        held = self._take_listener(transfer.port)
        if isinstance(transfer, WeightsNccl):
            self.group = await trio.to_thread.run_sync(
                functools.partial(NcclGroup, transfer, self.ranks.device, listener=held))
        else:
            timeout_s = max(self.cluster.handshake_timeout_s, self.cluster.weight_timeout_s) if first \
                else self.cluster.weight_timeout_s
            self.group = await trio.to_thread.run_sync(
                functools.partial(GlooGroup, transfer.host, transfer.port, 0, transfer.world_size, timeout_s,
                                  listener=held))

    def _take_listener(self, port: int) -> socket.socket | None:
        """The socket listening at `port` since it was offered, now the group's
        (None, and any other closed, if the controller names another port)."""
        held, self._listener = self._listener, None
        if held is not None and held.getsockname()[1] != port:
            held.close()
            held = None
        return held

    async def deal(self, batch: SampleBatch) -> tuple[dict[str, float], list[SampleBatch]]:
        return await trio.to_thread.run_sync(self.engine.prepare, batch, self.replicas)

    async def train(self, share: SampleBatch) -> dict[str, float]:
        return await trio.to_thread.run_sync(self.engine.step, share)

    async def publish(self, version: int) -> tuple[int, str]:
        snapshot = self.snapshots[version] = await trio.to_thread.run_sync(self.engine.snapshot)
        self._event(version).set()
        if self.server is not None:  # the adapter, whole at rank 0: served from now on
            self.server.publish(WeightsPayload(version=version, names=[s.name for s in self.engine.specs],
                                               tensors=[Tensor.from_torch(t) for t in snapshot]))
        return self.engine.nbytes, await trio.to_thread.run_sync(self.engine.checksum, snapshot)

    def _event(self, version: int) -> trio.Event:
        return self._published.setdefault(version, trio.Event())

    def new_group(self, transfer: WeightTransfer) -> WeightTransfer:
        """The next generation of the group, on a port this process listens on from now on."""
        if self._listener is not None:
            self._listener.close()
        self._listener = listener(self.host)
        return msgspec.structs.replace(transfer, host=self.host, port=self._listener.getsockname()[1],
                                       nbytes=self.engine.nbytes, bucket_bytes=self.engine.cfg.bucket_bytes)

    async def send(self, version: int, transfer: WeightTransfer | None, *, broadcast: bool = True) -> None:
        """Gather the weights of `version` with the other ranks; rank 0
        broadcasts them to the rollout replicas (joining `transfer`, a new
        generation of the group, first), unless not to `broadcast`."""
        if transfer is not None:
            self._let_go()
            await self.connect(transfer, first=False)
        await self._event(version).wait()  # this rank's own step may end a moment after rank 0's
        snapshot = self.snapshots[version]
        # Older versions will not be sent; this one is let go of once sent: a send that fails keeps
        # it, as the controller may move it again through a new generation of the group.
        self._forget(lambda v: v < version)
        if self.pulled:
            self._forget(lambda v: v == version)
            return  # served since it was published: the replicas fetch it
        group = self.group if self.ranks.lead and broadcast else None
        try:
            if isinstance(group, NcclGroup):
                await trio.to_thread.run_sync(self.engine.send_named, snapshot, functools.partial(_send_nccl, group))
            elif self.ranks.device.type == "cuda":  # a rank that only gathers
                await trio.to_thread.run_sync(self.engine.send_named, snapshot, None)
            else:
                broadcast = None if group is None else functools.partial(_broadcast, group)
                await trio.to_thread.run_sync(self.engine.send, snapshot, broadcast)
        except Exception:
            if self.group is group:
                self.group = None
            raise
        self._forget(lambda v: v == version)

    def _forget(self, which: Callable[[int], bool]) -> None:
        """Let go of the snapshots (and publish events) of the versions `which` picks."""
        for v in [v for v in self.snapshots if which(v)]:
            del self.snapshots[v]
            self._published.pop(v, None)

    def _let_go(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    async def save(self, folder: pathlib.Path, run_state: dict[str, int]) -> bool:
        await trio.to_thread.run_sync(self.engine.save, folder, run_state)
        return True

    async def close(self) -> None:
        self._let_go()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        # Abandoned if cancelled: a rank that died mid-step may leave this one's group unable to close.
        await trio.to_thread.run_sync(self.ranks.close, abandon_on_cancel=True)


def _broadcast(group: GlooGroup, piece: torch.Tensor) -> None:
    """One piece to every receiver. When it fails (a receiver died mid-way)
    the group is let go of at once: its connections close, and the receivers
    still waiting in this broadcast return (to join the next generation)."""
    try:
        group.broadcast(piece)
    except Exception:
        group.close()
        raise


def _send_nccl(group: NcclGroup, named: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Every parameter to every receiver; a failure lets go of the group."""
    try:
        group.send(named)
    except Exception:
        group.close()
        raise


def weight_offer(device: str, host: str, port: int, nbytes: int, bucket_bytes: int,
                 ranks_per_receiver: int = 1) -> WeightTransfer:
    """How a trainer on `device` ("cpu" or "cuda") sends weights: over gloo
    from the CPU, over NCCL (vLLM's `nccl` backend on the receivers, each
    `ranks_per_receiver` tensor-parallel workers) from a GPU."""
    if device == "cuda":
        return WeightsNccl(host=host, port=port, nbytes=nbytes, bucket_bytes=bucket_bytes,
                           ranks_per_receiver=ranks_per_receiver)
    return WeightsGloo(host=host, port=port, nbytes=nbytes, bucket_bytes=bucket_bytes)


