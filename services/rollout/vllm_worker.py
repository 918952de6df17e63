"""The part of the vLLM rollout that runs inside vLLM's engine-core process.

vLLM imports this module there (it is named in ``worker_extension_cls``),
which registers rlflow's gloo weight-transfer backend: a flat weight buffer
received over a standalone gloo group, piece by piece, and loaded layer by
layer as the pieces arrive (vLLM's own backends need an accelerator). Its
`WorkerExtension` takes LoRA adapters the same way (or over vLLM's NCCL
group) straight into vLLM's LoRA manager. It imports only torch, vLLM, the
protocol's `ParamSpec` and the weight helpers: nothing of trio, the config
or the service.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlflow.protocol import ParamSpec
from rlflow.services import compat
from rlflow.services.weights import GlooGroup, receive_pieces, tensors_checksum

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


class WorkerExtension:
    """Named in vLLM's ``worker_extension_cls``: vLLM mixes it into its worker
    class, so the engine-core process imports this module (which registers
    the gloo backend), and its methods are the worker's, called through
    ``collective_rpc``: LoRA adapters taken over the weight group and handed
    to vLLM's LoRA manager from memory (no file on the way)."""

    def rlflow_load_adapter(self, info: dict[str, Any]) -> str:
        """Take one adapter version and hand it to vLLM's LoRA manager as adapter
        ``lora_id`` (taking the place of the one of that id with ``replace``):
        from the weight group (``source`` "group", laid out as the layout
        says), the bytes of each tensor handed over with the call
        ("tensors", in the layout's order: fetched from the trainer's weight
        server), a PEFT adapter directory ("file", ``path``) or zeros
        ("zeros": the base itself). Its checksum (SPEC.md, *Checksums*) as
        received, or empty if vLLM does not hold it afterwards."""
        specs = [ParamSpec(name=n, dtype=d, shape=s, offset=o)
                 for n, d, s, o in zip(info["names"], info["dtypes"], info["shapes"], info["offsets"])]
        named = _adapter_tensors(self, info, specs)
        # Before vLLM has it: its manager folds the scale into B in place.
        checksum = tensors_checksum(specs, [t for _, t in named])
        compat.register_adapter(self.model_runner, info["lora_id"], dict(named), info["rank"], info["alpha"],
                                info["targets"], replace=info["replace"])
        return checksum if info["lora_id"] in compat.adapter_ids(self.model_runner) else ""

    def rlflow_unload_adapter(self, lora_id: int) -> bool:
        """Let go of adapter `lora_id` (no request uses it any more)."""
        return compat.unregister_adapter(self.model_runner, lora_id)


def _adapter_tensors(worker: Any, info: dict[str, Any], specs: list[ParamSpec]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the adapter, in the layout's order."""
    source = info["source"]
    if source == "zeros":
        return [(s.name, torch.zeros(s.shape, dtype=getattr(torch, s.dtype))) for s in specs]
    if source == "tensors":
        return [(s.name, torch.frombuffer(bytearray(data), dtype=getattr(torch, s.dtype)).reshape(s.shape))
                for s, data in zip(specs, info["tensors"], strict=True)]
    if source == "file":
        from safetensors.torch import load_file

        saved = load_file(str(pathlib.Path(info["path"]) / "adapter_model.safetensors"))
        if set(saved) != {s.name for s in specs}:
            raise ValueError(f"the adapter in {info['path']} is not the one the trainer sends: it has "
                             f"{sorted(set(saved) ^ {s.name for s in specs})[:3]} where they differ")
        return [(s.name, saved[s.name]) for s in specs]
    engine = worker.weight_transfer_engine
    if isinstance(engine, GlooWeightTransferEngine):
        if engine.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
        group = engine.group
        return list(receive_pieces(lambda piece: group.broadcast(piece, root=0), specs, info["nbytes"],
                                   info["bucket_bytes"]))
    return compat.nccl_receive_packed(engine, [(s.name, s.shape, getattr(torch, s.dtype)) for s in specs])


compat.register_weight_transfer(BACKEND, GlooWeightTransferEngine)
