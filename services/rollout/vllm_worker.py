"""The part of the vLLM rollout that runs inside vLLM's engine-core process.

vLLM imports this module there (it is named in ``worker_extension_cls``),
which registers rlflow's gloo weight-transfer backend: a flat weight buffer
received over a standalone gloo group, piece by piece, and loaded layer by
layer as the pieces arrive (vLLM's own backends need an accelerator).
`vllm_lora_worker`, which vLLM is told to import, takes LoRA adapters the
same way (or over vLLM's NCCL group) and imports this module. It imports
only torch, vLLM, the protocol's `ParamSpec` and the weight helpers: nothing
of trio, the config or the service.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlflow.protocol import ParamSpec
from rlflow.services import compat
from rlflow.services.weights import GlooGroup, receive_pieces

BACKEND = "rlflow-gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    rank: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    nbytes: int
    bucket_bytes: int = 0
    """The pieces the buffer comes in (see `rlflow.services.weights.pieces`; 0: one)."""


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives a flat weight buffer over gloo, one piece at a time, and loads it layer by layer."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.group: GlooGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.group = GlooGroup(init_info.host, init_info.port, init_info.rank, init_info.world_size,
                               init_info.timeout_s)

    def start_weight_update(self) -> None:
        compat.begin_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Overrides the base class's, which synchronizes an accelerator (on
        # CPU there is none); checked in `compat`.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
        specs = [
            ParamSpec(name=n, dtype=d, shape=s, offset=o)
            for n, d, s, o in zip(info.names, info.dtypes, info.shapes, info.offsets)
        ]
        group = self.group
        # One load over every piece: vLLM takes each parameter as its piece arrives.
        self.model.load_weights(receive_pieces(lambda piece: group.broadcast(piece, root=0), specs, info.nbytes,
                                               info.bucket_bytes))

    def finish_weight_update(self) -> None:
        compat.end_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = None


compat.register_weight_transfer(BACKEND, GlooWeightTransferEngine)
