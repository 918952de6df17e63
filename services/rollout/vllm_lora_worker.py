"""The LoRA side of the vLLM rollout inside vLLM's engine-core process.

vLLM imports this module there: its `WorkerExtension` is named in
``worker_extension_cls``, and importing it imports `vllm_worker`, which
registers rlflow's gloo weight-transfer backend. An adapter version comes
over the weight group (gloo, or vLLM's NCCL group), as bytes handed over
with the call, from a PEFT adapter directory, or as zeros, and goes straight
into vLLM's LoRA manager from memory (no file on the way). Like
`vllm_worker`, it imports only torch, vLLM, the protocol's `ParamSpec` and
the weight helpers: nothing of trio, the config or the service.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

from rlflow.protocol import ParamSpec
from rlflow.services import compat
from rlflow.services.rollout.vllm_worker import GlooWeightTransferEngine
from rlflow.services.weights import receive_pieces, tensors_checksum


class WorkerExtension:
    """Named in vLLM's ``worker_extension_cls``: vLLM mixes it into its worker
    class, so the engine-core process imports this module (and with it
    `vllm_worker`, which registers the gloo backend), and its methods are the worker's, called through
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
