"""What the vLLM rollout serves and how it takes each new version: the whole
model, loaded in place (`WholeWeights`), or LoRA adapter versions on the
base (`AdapterVersions`). The engine holds one of them (the whole model
until the trainer's welcome names an adapter) and calls it for every
difference between the two.

An adapter comes from the weight group (gloo, or vLLM's NCCL group), or
from the trainer's weight server over ZeroMQ, and reaches vLLM's LoRA
manager from memory (`vllm_lora_worker`). In place (`AdapterUpdate.IN_PLACE`)
it replaces the one served between two steps, under one LoRA id; per
request (`AdapterUpdate.PER_REQUEST`) each version is loaded beside the
others under an id of its own, every request keeps the version it started
on, and the oldest are let go of once more than `Adapter.versions` are held.
"""

from __future__ import annotations

from typing import Any

from rlflow.protocol import Adapter, AdapterUpdate, ParamSpec, WeightsPayload, WeightsZmq, WeightTransfer
from rlflow.services.base import EngineContext
from rlflow.services.vllm_client import IN_PLACE_ID, VllmBackend, gloo_update_info
from rlflow.services.zmq_weights import fetch, open_fetcher


def adapter_slots(update: str, staleness: int) -> int:
    """vLLM's LoRA slots for `lora.adapter_update`: one adapter in place; per
    request, the max_staleness + 1 kept and two more for versions let go of
    while their last requests end (they are unloaded after those)."""
    return 1 if update == "in_place" else staleness + 3


class WholeWeights:
    """The whole model, each version received over the weight group and loaded in place."""

    #: The LoRA adapter served on the base (None: none).
    adapter: Adapter | None = None
    #: Each request keeps the version it started with (else its later tokens carry the newer ones).
    per_request = False
    #: The checksum of the version served (SPEC.md, *Checksums*; empty: not checked).
    checksum = ""

    def __init__(self, backend: VllmBackend, kv: str) -> None:
        self.backend, self.kv = backend, kv

    def check(self, transfer: WeightTransfer) -> None:
        """Refuse a transfer these weights cannot come by: whole weights never come over ZeroMQ."""
        if isinstance(transfer, WeightsZmq):
            raise ValueError("the vLLM rollout takes whole weights over a collective group (gloo on CPUs, NCCL "
                             "on GPUs); over ZeroMQ only a LoRA adapter, and the trainer sends whole weights "
                             "(roles.trainer.engine.lora.transfer = \"zmq\" needs roles.trainer.engine.lora)")

    def lora_id(self, version: int) -> int:
        """The LoRA id requests started on `version` run under (0: none, the base alone)."""
        return 0

    async def load(self, version: int, transfer: WeightTransfer, layout: list[ParamSpec]) -> int:
        """Take `version` over the weight group `transfer` (laid out as `layout` says); the version loaded."""
        await self.backend.update(version, layout, transfer.nbytes, kv=self.kv, bucket_bytes=transfer.bucket_bytes)
        return version

    def falling_out(self, version: int) -> list[int]:
        """The versions to let go of with `version` the newest (per request: those past the window)."""
        return []

    async def retire(self, versions: list[int]) -> None:
        """Let go of `versions` (once no request runs on them)."""


class AdapterVersions(WholeWeights):
    """LoRA `adapter` versions on the base of `backend` (see the module docstring)."""

    def __init__(self, backend: VllmBackend, kv: str, ctx: EngineContext, adapter: Adapter) -> None:
        if backend.lora_rank < adapter.rank:
            raise ValueError(f"the trainer sends a LoRA adapter of rank {adapter.rank}, but this rollout's vLLM "
                             f"serves adapters of rank {backend.lora_rank} at most (0: none); both read "
                             "roles.trainer.engine.lora")
        super().__init__(backend, kv)
        self.ctx = ctx
        self.adapter = adapter
        self.per_request = adapter.update == AdapterUpdate.PER_REQUEST
        #: The LoRA id of each version loaded.
        self.ids: dict[int, int] = {}

    def check(self, transfer: WeightTransfer) -> None:
        """An adapter comes over any transfer."""

    def lora_id(self, version: int) -> int:
        return self.ids[version] if self.per_request else IN_PLACE_ID

    def _info(self, source: str, lora_id: int, transfer: WeightTransfer | None, layout: list[ParamSpec],
              path: str = "") -> dict[str, Any]:
        """What `vllm_lora_worker.WorkerExtension.rlflow_load_adapter` is handed."""
        adapter = self.adapter
        # The group's buffer (none over ZeroMQ, or before a group is joined).
        nbytes, bucket_bytes = getattr(transfer, "nbytes", 0), getattr(transfer, "bucket_bytes", 0)
        return {**gloo_update_info(layout, nbytes, bucket_bytes), "source": source, "path": path,
                "lora_id": lora_id, "rank": adapter.rank, "alpha": adapter.alpha, "targets": list(adapter.targets),
                "replace": True}

    async def first(self, version: int, transfer: WeightTransfer | None, layout: list[ParamSpec]) -> None:
        """Serve the adapter of `version`, the one held now: a checkpoint's resumed
        from (PEFT's format, read by the engine), else zeros (version 0: the
        base itself, which PEFT's B = 0 makes it)."""
        path = self.ctx.config.adapter_path
        lora_id = IN_PLACE_ID if not self.per_request else version + 1
        self.checksum = await self.backend.load_adapter(
            self._info("file" if path else "zeros", lora_id, transfer, layout, path))
        self.ids[version] = lora_id

    async def load(self, version: int, transfer: WeightTransfer, layout: list[ParamSpec]) -> int:
        """Take adapter `version` from the weight group, or from the trainer's
        weight server (ZeroMQ: fetched before generation pauses; a newer
        version than asked for if the trainer has one). In place: it replaces
        the one served between two steps. Per request: it is loaded beside
        the others (`falling_out` says which to let go of). The version loaded."""
        source, tensors = "group", None
        if isinstance(transfer, WeightsZmq):
            payload = await self._fetch(transfer, version)
            source, version, tensors = "tensors", payload.version, _in_layout(payload, layout)
        lora_id = version + 1 if self.per_request else IN_PLACE_ID
        info = {**self._info(source, lora_id, transfer, layout), "tensors": tensors}
        if not self.per_request:
            self.checksum = await self.backend.load_adapter(info, pause=True, kv=self.kv, version=version)
            return version
        self.checksum = await self.backend.load_adapter(info)
        self.ids[version] = lora_id
        return version

    async def _fetch(self, transfer: WeightsZmq, version: int) -> WeightsPayload:
        """Adapter `version` (or newer) from the weight server, over a socket of this call's own."""
        async with open_fetcher(self.ctx, transfer.address) as weights:
            return await fetch(self.ctx, weights, version)

    def falling_out(self, version: int) -> list[int]:
        return [v for v in self.ids if version - v >= self.adapter.versions] if self.per_request else []

    async def retire(self, versions: list[int]) -> None:
        for v in versions:
            await self.backend.retire_adapter(self.ids.pop(v))


def _in_layout(payload: WeightsPayload, layout: list[ParamSpec]) -> list[bytes]:
    """The bytes of the payload's tensors in the layout's order; an error naming what differs if it is
    not the adapter the welcome described."""
    got = dict(zip(payload.names, payload.tensors, strict=True))
    named = {s.name: s for s in layout}
    if set(got) != set(named):
        raise ValueError(f"the weight server sent v{payload.version} with tensors that are not the adapter's "
                         f"layout: {sorted(set(got) ^ set(named))[:3]} where they differ")
    out = []
    for spec in layout:
        tensor = got[spec.name]
        if tensor.dtype != spec.dtype or list(tensor.shape) != list(spec.shape):
            raise ValueError(f"the weight server sent {spec.name} as {tensor.dtype}{list(tensor.shape)}; the "
                             f"layout says {spec.dtype}{list(spec.shape)}")
        # Bytes of its own (not the socket's frame or a shared segment), as vLLM's utility calls carry them.
        out.append(bytes(memoryview(tensor.data).cast("B")))
    return out
