"""The rollout's vLLM engine, driven from trio through the vLLM client
(`rlflow.services.vllm_client`: vLLM's `AsyncLLM` on an asyncio thread of its
own, every call bridged there and back).

Each prompt group is one request with ``n`` samples; the group is sent on
the moment its last sample finishes. Every sampled token comes with its
log-probability under the sampling distribution and the policy version that
produced it (vLLM's weight-version spans). A request that fails becomes
failed samples in the batch (`FinishReason.ERROR`), and the engine goes on.

Weights, on CPU: a gloo process group with the trainer, received by
rlflow's own weight-transfer backend inside vLLM's engine-core process
(`vllm_worker`). On CUDA: vLLM's own `nccl` backend, every worker of every
replica in one NCCL group with the trainer's rank 0 (`WeightsNccl`; each
tensor-parallel worker its own rank). Which one is chosen when the engine
starts, by its platform; the trainer's offer must match. An update pauses
the engine with its requests kept, receives the weights piece by piece (or
vLLM's packed chunks) and loads them, and resumes: requests in flight go on
over their KV cache (or recompute it under the new weights,
``kv_on_update = "recompute"``) and their later tokens carry the new version.

With `vllm_worker` and the vLLM client, this module is the only place that imports vLLM.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from rlflow.algo.staleness import too_stale
from rlflow.config import VllmRollout
from rlflow.protocol import (
    Adapter, AdapterUpdate, EngineLoad,
    FinishReason, ParamSpec, PromptGroup, Response, Stage, WeightsGloo, WeightsNccl, WeightsPayload, WeightsZmq,
    WeightTransfer
)
from rlflow.protocol.batch import N_STAGES
from rlflow.services import compat
from rlflow.services.base import EngineContext
from rlflow.errors import WeightGroupBroken
from rlflow.services.rollout.engine import VersionWait
from rlflow.services.vllm_client import EVAL_PRIORITY, IN_PLACE_ID, NCCL, VllmBackend, gloo_update_info
from rlflow.services.zmq_weights import fetch, open_fetcher


@dataclass
class _Group:
    group: PromptGroup
    issued_at: float
    submitted_version: int = 0
    scope: trio.CancelScope | None = None  # of its generation, while running


class VllmEngine:
    """Generates prompt groups with vLLM (see the module docstring)."""

    def __init__(
        self,
        cfg: VllmRollout,
        ctx: EngineContext,
        backend: VllmBackend | None = None,
        joined: tuple[WeightsGloo | WeightsNccl, list[ParamSpec]] | None = None,
    ) -> None:
        """`backend`: a started engine to share (tests, benches), `joined`: the
        weight group it has already joined."""
        self.cfg = cfg
        self.ctx = ctx
        self.clock = ctx.clock
        run = ctx.config.run
        self.staleness = run.staleness
        self.strict = run.staleness_check == "strict"
        lora = ctx.config.lora
        slots = adapter_slots(lora.adapter_update, run.staleness) if lora else 1
        self.backend = backend or VllmBackend(cfg, ctx.config.policy_path, run.seed + ctx.rank,
                                              lora_rank=lora.rank if lora else 0, lora_slots=slots)
        self._owns_backend = backend is None
        self.version = 0
        self.pending: deque[_Group] = deque()
        self.running: dict[int, _Group] = {}
        self._send, self.finished = trio.open_memory_channel(2)
        self._wake = trio.Event()
        self._weights: WeightTransfer | None = None
        self._layout: list[ParamSpec] = []
        self._weights_ready = trio.Event()
        self._weights_changed = VersionWait()
        if joined is not None:
            (self._weights, self._layout) = joined
            self._weights_ready.set()
        self._updating = False
        #: LoRA: the adapter served on the base (None: whole weights), the
        #: LoRA id of each version loaded, and the checksum of the newest.
        self.adapter: Adapter | None = None
        self._lora_ids: dict[int, int] = {}
        self.checksum = ""
        #: Episodes' turns being generated.
        self._turns = 0

    @property
    def eval_concurrency(self) -> int:
        return self.cfg.max_num_seqs

    def queues(self) -> dict[str, int]:
        return {"pending": len(self.pending), "running": len(self.running)}

    def hello_fields(self) -> dict[str, Any]:
        return {"model": self.backend.model_path, "slots": self.cfg.max_num_seqs}

    def load(self) -> EngineLoad:
        return self.backend.load(self.cfg.max_num_seqs)

    # -- start-up ---------------------------------------------------------------

    async def start(self) -> None:
        if self.backend.llm is None:
            await trio.to_thread.run_sync(self.backend.start_blocking)
        await self.set_version(self.version)

    async def set_version(self, version: int) -> None:
        self.version = version
        await self.backend.set_version(version)
        self._weights_changed.changed()

    async def close(self) -> None:
        if self._owns_backend:
            await trio.to_thread.run_sync(self.backend.close)

    async def join_weights(self, transfer: WeightTransfer | None, layout: list[ParamSpec],
                           adapter: Adapter | None = None, *, first: bool = True) -> None:
        """Join the trainer's weight group (returns once the trainer has joined
        too); none: a replacement, which joins the next generation of the group.
        The first group waits as long as a start may take; a later generation
        `cluster.weight_timeout_s`. With `adapter`, serve the base with it from
        now on, starting with the adapter of the version held (zeros, or the
        checkpoint resumed from)."""
        self._layout = layout or self._layout
        if adapter is not None and self.adapter is None:
            await self._first_adapter(adapter)
        if transfer is None:
            return
        if isinstance(transfer, WeightsZmq):
            if self.adapter is None:
                raise ValueError("the vLLM rollout takes whole weights over a collective group (gloo on CPUs, NCCL "
                                 "on GPUs); over ZeroMQ only a LoRA adapter, and the trainer sends whole weights "
                                 "(roles.trainer.engine.lora.transfer = \"zmq\" needs roles.trainer.engine.lora)")
            self._weights = transfer
            self._weights_ready.set()
            return
        check_offer(self.backend.weight_backend(), transfer)
        cluster = self.ctx.config.cluster
        timeout_s = max(cluster.handshake_timeout_s, cluster.weight_timeout_s) if first else cluster.weight_timeout_s
        if isinstance(transfer, WeightsNccl):
            await self.backend.join_nccl(transfer)
        else:
            await self.backend.join_weights(transfer.host, transfer.port, transfer.rank, transfer.world_size,
                                            timeout_s)
        self._weights = transfer
        self._weights_ready.set()

    # -- called by the service ----------------------------------------------------

    def submit(self, group: PromptGroup, issued_at: float) -> None:
        self.pending.append(_Group(group, issued_at))
        self._wake.set()

    async def update_weights(self, version: int, transfer: WeightTransfer | None) -> int:
        if transfer is not None:
            await self.join_weights(transfer, self._layout, first=False)
        await self._weights_ready.wait()
        self._updating = True
        self.clock.set("loading")
        try:
            if self.adapter is not None:
                version = await self._load_adapter(version)
            else:
                await self.backend.update(version, self._layout, self._weights.nbytes, kv=self.cfg.kv_on_update,
                                          bucket_bytes=self._weights.bucket_bytes)
        except Exception as exc:
            if compat.engine_dead(exc):  # nothing more can be loaded or served: the replica ends, to be restarted
                raise EngineDead(f"vLLM's engine died while loading weights v{version}: {exc}") from exc
            if isinstance(exc, RuntimeError):  # gloo: "Connection closed by peer", a timeout; an NCCL error
                raise WeightGroupBroken(f"{type(exc).__name__}: {exc}") from exc
            raise
        finally:
            self._updating = False
        self.version = version
        if self.per_request:
            await self._keep_window()
        if self.strict:
            self._evict_stale()
        self._wake.set()
        self._weights_changed.changed()
        return self.version

    # -- LoRA ---------------------------------------------------------------------

    @property
    def per_request(self) -> bool:
        """Each request keeps the adapter version it started with (`AdapterUpdate.PER_REQUEST`)."""
        return self.adapter is not None and self.adapter.update == AdapterUpdate.PER_REQUEST

    def _lora_id(self, version: int) -> int:
        """The LoRA id requests started on `version` run under (0: no adapter)."""
        if self.adapter is None:
            return 0
        return self._lora_ids[version] if self.per_request else IN_PLACE_ID

    def _adapter_info(self, source: str, lora_id: int, path: str = "") -> dict[str, Any]:
        adapter, weights = self.adapter, self._weights
        # The group's buffer (none over ZeroMQ, or before a group is joined).
        nbytes, bucket_bytes = getattr(weights, "nbytes", 0), getattr(weights, "bucket_bytes", 0)
        return {**gloo_update_info(self._layout, nbytes, bucket_bytes), "source": source, "path": path,
                "lora_id": lora_id, "rank": adapter.rank, "alpha": adapter.alpha, "targets": list(adapter.targets),
                "replace": True}

    async def _first_adapter(self, adapter: Adapter) -> None:
        """Serve the adapter of the version held now: a checkpoint's resumed
        from (PEFT's format, read by the engine), else zeros (version 0: the
        base itself, which PEFT's B = 0 makes it)."""
        if self.backend.lora_rank < adapter.rank:
            raise ValueError(f"the trainer sends a LoRA adapter of rank {adapter.rank}, but this rollout's vLLM "
                             f"serves adapters of rank {self.backend.lora_rank} at most (0: none); both read "
                             "roles.trainer.engine.lora")
        self.adapter = adapter
        path = self.ctx.config.adapter_path
        lora_id = IN_PLACE_ID if not self.per_request else self.version + 1
        self.checksum = await self.backend.load_adapter(self._adapter_info("file" if path else "zeros", lora_id, path))
        self._lora_ids[self.version] = lora_id

    async def _load_adapter(self, version: int) -> int:
        """Take adapter `version` from the weight group, or from the trainer's
        weight server (ZeroMQ: fetched before generation pauses; a newer
        version than asked for if the trainer has one). In place: it replaces
        the one served between two steps. Per request: it is loaded beside
        the others (and `_keep_window` lets go of the oldest). The version loaded."""
        source, tensors = "group", None
        if isinstance(self._weights, WeightsZmq):
            payload = await self._fetch(version)
            source, version, tensors = "tensors", payload.version, self._in_layout(payload)
        lora_id = version + 1 if self.per_request else IN_PLACE_ID
        info = {**self._adapter_info(source, lora_id), "tensors": tensors}
        if not self.per_request:
            self.checksum = await self.backend.load_adapter(info, pause=True, kv=self.cfg.kv_on_update,
                                                            version=version)
            return version
        self.checksum = await self.backend.load_adapter(info)
        self._lora_ids[version] = lora_id
        return version

    async def _fetch(self, version: int) -> WeightsPayload:
        """Adapter `version` (or newer) from the weight server, over a socket of this call's own."""
        async with open_fetcher(self.ctx, self._weights.address) as weights:
            return await fetch(self.ctx, weights, version)

    def _in_layout(self, payload: WeightsPayload) -> list[bytes]:
        """The bytes of the payload's tensors in the layout's order; an error naming what differs if it is
        not the adapter the welcome described."""
        got = dict(zip(payload.names, payload.tensors, strict=True))
        named = {s.name: s for s in self._layout}
        if set(got) != set(named):
            raise ValueError(f"the weight server sent v{payload.version} with tensors that are not the adapter's "
                             f"layout: {sorted(set(got) ^ set(named))[:3]} where they differ")
        out = []
        for spec in self._layout:
            tensor = got[spec.name]
            if tensor.dtype != spec.dtype or list(tensor.shape) != list(spec.shape):
                raise ValueError(f"the weight server sent {spec.name} as {tensor.dtype}{list(tensor.shape)}; the "
                                 f"layout says {spec.dtype}{list(spec.shape)}")
            # Bytes of its own (not the socket's frame or a shared segment), as vLLM's utility calls carry them.
            out.append(bytes(memoryview(tensor.data).cast("B")))
        return out

    async def _keep_window(self) -> None:
        """Per request, with the newest version held: let go of the versions
        before the last `Adapter.versions`, starting the groups still running
        on them again (on the newest)."""
        old = [v for v in self._lora_ids if self.version - v >= self.adapter.versions]
        for item in list(self.running.values()):
            if item.submitted_version in old and item.scope is not None and not item.scope.cancel_called:
                self.ctx.counters["restarted_groups"] += 1
                item.scope.cancel()
                self.pending.appendleft(item)
        for v in old:
            await self.backend.retire_adapter(self._lora_ids.pop(v))

    def _evict_stale(self) -> None:
        """Restart groups whose first tokens are already too old to be trained on."""
        for item in list(self.running.values()):
            if too_stale(item.submitted_version, self.version, self.staleness) and not item.scope.cancel_called:
                self.ctx.counters["restarted_groups"] += 1
                item.scope.cancel()
                self.pending.appendleft(item)

    # -- the loop -------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with self._send, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                while self.pending and self.pending[0].group.min_version <= self.version:
                    item = self.pending.popleft()
                    item.submitted_version = self.version
                    scope = item.scope = trio.CancelScope()
                    self.running[item.group.group_id] = item
                    nursery.start_soon(self._generate_group, item, scope)
                self._retime()
                self._wake = trio.Event()
                await self._wake.wait()

    def _retime(self) -> None:
        if self._updating:
            return
        if self.running or self._turns:
            self.clock.set("busy")
        elif self.pending:
            self.clock.set("loading")  # waiting for the weights a barrier asks for
        else:
            self.clock.set("starved")

    async def _generate_group(self, item: _Group, scope: trio.CancelScope) -> None:
        group_id = item.group.group_id
        try:
            with scope:
                started = time.time()
                try:
                    output = await self.backend.generate(item.group.prompt_ids, item.group.n, self.cfg.temperature,
                                                         lora_id=self._lora_id(item.submitted_version))
                    responses = self._responses(output, item, started)
                except Exception as exc:
                    if compat.engine_dead(exc):  # nothing more can be served: the replica ends, to be restarted
                        raise EngineDead(f"vLLM's engine died while generating group {group_id}: {exc}") from exc
                    # Per request: failed samples in the batch, the engine goes on.
                    self.ctx.counters["failed_requests"] += 1
                    self.ctx.log.warning("[%s] group %d failed: %s: %s",
                                         self.ctx.name, group_id, type(exc).__name__, exc)
                    responses = [_failed(item, started, exc)] * item.group.n
            if scope.cancelled_caught:
                return
        finally:
            if item.scope is scope:  # not restarted meanwhile
                del self.running[group_id]
                item.scope = None
            self._wake.set()
        await self._send.send([(item.group, responses)])

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, min_version: int = 0,
                       temperature: float | None = None) -> Response:
        """One response (an episode's turn) to `prompt_ids`, of at most `max_tokens` tokens, not
        started on weights older than `min_version` (`temperature`: the config's if None)."""
        # A barrier: the weights it may start on are on their way.
        await self._weights_changed.reach(min_version, lambda: self.version)
        temperature = self.cfg.temperature if temperature is None else temperature
        item = _Group(PromptGroup(group_id=0, prompt_ids=[], n=1), time.time(), submitted_version=self.version)
        self._turns += 1
        self._retime()
        started = time.time()
        try:
            output = await self.backend.generate(prompt_ids, 1, temperature, max_tokens=max_tokens,
                                                 lora_id=self._lora_id(item.submitted_version))
        except Exception as exc:
            if compat.engine_dead(exc):
                raise EngineDead(f"vLLM's engine died while generating an episode's turn: {exc}") from exc
            self.ctx.counters["failed_requests"] += 1
            return _failed(item, started, exc)
        finally:
            self._turns -= 1
            self._retime()
        return self._responses(output, item, started)[0]

    async def complete(self, prompt_ids: list[int], temperature: float) -> list[int]:
        """One answer to `prompt_ids` (for evaluation: not a training sample; served before training's)."""
        output = await self.backend.generate(prompt_ids, 1, temperature, lora_id=self._lora_id(self.version),
                                             priority=EVAL_PRIORITY)
        return list(output.outputs[0].token_ids)

    def _responses(self, output, item: _Group, started: float) -> list[Response]:
        out = []
        for completion in output.outputs:
            ids = np.asarray(completion.token_ids, dtype=np.int32)
            logprobs = np.fromiter(
                (lp[token].logprob for token, lp in zip(completion.token_ids, completion.logprobs or [])),
                dtype=np.float32,
                count=len(ids),
            ) if completion.logprobs else np.zeros(len(ids), np.float32)  # greedy: none asked for
            versions = np.full(len(ids), item.submitted_version, dtype=np.int32)
            # Per request, every token is the adapter version it started on, whatever vLLM's label.
            for span in () if self.per_request else completion.weight_versions or ():
                versions[span.start : span.end] = int(span.version)
            out.append(
                Response(
                    token_ids=ids,
                    logprobs=logprobs,
                    versions=versions,
                    finish_reason=_FINISH.get(completion.finish_reason, FinishReason.ABORT),
                    stamps=_stamps(item, started),
                )
            )
        return out


def adapter_slots(update: str, staleness: int) -> int:
    """vLLM's LoRA slots for `lora.adapter_update`: one adapter in place; per
    request, the max_staleness + 1 kept and two more for versions let go of
    while their last requests end (they are unloaded after those)."""
    return 1 if update == "in_place" else staleness + 3


class EngineDead(RuntimeError):
    """vLLM's engine core is gone: the replica cannot serve any request."""


def check_offer(backend: str, transfer: WeightTransfer) -> None:
    """Refuse a transfer the engine's weight backend cannot receive: NCCL
    (`WeightsNccl`) on CUDA, gloo (`WeightsGloo`) otherwise."""
    wanted = WeightsNccl if backend == NCCL else WeightsGloo
    if not isinstance(transfer, wanted):
        where = "CUDA (vLLM's nccl backend)" if backend == NCCL else "CPU (gloo)"
        raise ValueError(f"the vLLM rollout on {where} receives weights as {wanted.__name__}; the trainer offers "
                         f"{transfer!r} (trainer and rollout must both be on GPUs, or both on CPUs)")


_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def _stamps(item: _Group, started: float) -> np.ndarray:
    stamps = np.full(N_STAGES, np.nan)
    stamps[Stage.ISSUED] = item.issued_at
    stamps[Stage.ROLLOUT_START] = started
    stamps[Stage.ROLLOUT_END] = time.time()
    return stamps


def _failed(item: _Group, started: float, exc: Exception) -> Response:
    """A sample of a request the engine could not generate."""
    empty = np.zeros(0, np.int32)
    return Response(
        token_ids=empty,
        logprobs=np.zeros(0, np.float32),
        versions=empty,
        finish_reason=FinishReason.ERROR,
        stamps=_stamps(item, started),
        error=f"{type(exc).__name__}: {exc}"[:500],
    )
