"""The vLLM client: vLLM's `AsyncLLM` on an asyncio event loop of its own
thread, driven from trio, with the calls the roles that run vLLM make (the
rollout generates and loads weights; a scoring role takes prompt log-probabilities).

Every call from trio is bridged to that loop and back (`AsyncioBridge`).
Cancelling the trio side cancels the asyncio task, which aborts the vLLM
request; results delivered after the trio side has gone are dropped. A call
made before vLLM's engine core died ends with vLLM's `EngineDeadError`
(`unless_dead`), never a hang.

With `rollout/vllm_worker` and `rollout/vllm_lora_worker` (the side inside
vLLM's engine-core process), this module and the rollout's engine are the
only places that import vLLM.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psutil
import trio

from rlflow.config import VllmRollout
from rlflow.protocol import EngineLoad, ParamSpec, WeightsNccl
from rlflow.services import compat
from rlflow.services.base import cpu_ranges
from rlflow.services.rollout.vllm_worker import BACKEND
from rlflow.services.weights import NCCL_BUFFERS, nccl_chunk_bytes, nccl_ranks


#: vLLM's own weight-transfer backend over NCCL (CUDA).
NCCL = "nccl"
#: The LoRA id of the one adapter served with `AdapterUpdate.IN_PLACE`.
IN_PLACE_ID = 1
#: What a request's adapter claims as its directory: adapters reach vLLM from
#: memory, never from a file, so if vLLM ever looked here (an adapter let go
#: of while a request used it) it would fail naming this.
ADAPTER_PATH = "/rlflow/adapter-received-over-the-weight-group"
#: On CPU, how long vLLM's engine-core process and its worker get to exit
#: after `close` before vLLM kills them. Once their loops have ended they
#: hold nothing of the run's; what is left is interpreter teardown, which took
#: 2-5 s on a 2-core machine (vLLM's default grace is 5 s, after which it
#: kills them anyway) and held up the end of every run. Shared memory and
#: socket files are left no more than by vLLM's own kill. On a GPU, vLLM's
#: default stands: its teardown releases device memory.
CPU_EXIT_GRACE_S = 1.0
#: vLLM on CPU runs its model worker in a process of its own beside the
#: engine core unless multiprocessing is off where the engine's config is
#: made. With one worker (no tensor parallelism) that process only costs:
#: the worker inside the engine core started a tiny model in 17 s against
#: 30 s (one import of vLLM fewer) and generated 4.4k tokens/s against 3.3k
#: (no shared-memory queue between the two) on a 2-core AMD EPYC. The engine
#: core is still a process of its own: AsyncLLM always starts one.
#: Set to "0" for the one call that makes the config, unless set already.
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
#: `enforce_eager` leaves vLLM's own helpers compiled: the sampler counts each
#: sampled token's rank with a `torch.compile`d function, which the inductor
#: compiles (C++, with the machine's compiler) at an engine's first sampled
#: request with log-probabilities: 2.1-2.5 s of every CPU engine's first
#: step on a 2-core AMD EPYC (first sampled batch 2.1 s against 0.22 s), and
#: more with two engines starting together. On CPU with `enforce_eager`, the
#: engine core starts with torch.compile off (set for the call that spawns
#: it, unless set already): the same functions, run as they are written.
COMPILE_ENV = "TORCH_COMPILE_DISABLE"


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


#: How often a call waiting on vLLM looks whether its engine core died. vLLM
#: answers a request on a dead engine with `EngineDeadError`, but leaves a
#: utility call (pause, load weights, ...) made before the death waiting forever.
DEAD_POLL_S = 0.5


async def unless_dead(awaitable: Awaitable[Any], dead: Callable[[], bool], poll_s: float = DEAD_POLL_S) -> Any:
    """Await `awaitable` (on asyncio), unless `dead()` turns true first: then
    cancel it and raise vLLM's `EngineDeadError`."""
    from vllm.v1.engine.exceptions import EngineDeadError

    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() and dead():
                raise EngineDeadError()
        return task.result()
    finally:
        task.cancel()


#: vLLM's priority of an evaluation's requests (training's are 0; lower goes first).
EVAL_PRIORITY = -1


class VllmBackend:
    """vLLM's AsyncLLM on its asyncio thread, with the calls the rollout needs.

    Its coroutines may be awaited from any trio run (a test session shares
    one backend across tests; a service owns one).
    """

    def __init__(self, cfg: VllmRollout, model_path: str, seed: int = 0, *, max_logprobs: int = 20,
                 weights: str | None = None, lora_rank: int = 0, lora_slots: int = 1, seeded: bool = False):
        """`weights`: the weight-transfer backend, vLLM's "nccl" or rlflow's
        gloo one (`vllm_worker.BACKEND`); None: "nccl" on CUDA, else gloo.
        `lora_rank`: serve LoRA adapters of up to this rank, `lora_slots` of
        them at once (0: no LoRA). `seeded`: requests come with seeds of their own
        (`generate`'s `seed`), and each prompt is computed whole (see `engine_args`)."""
        self.cfg = cfg
        self.lora_rank, self.lora_slots = lora_rank, lora_slots
        #: Asyncio side: requests running per adapter, and adapters to let go of once none does.
        self._users: dict[int, int] = {}
        self._retired: set[int] = set()
        self._unloading: set[asyncio.Task] = set()
        self.weights = weights
        self.model_path = model_path
        self.seed = seed
        self.seeded = seeded
        self.max_logprobs = max_logprobs
        self.bridge: AsyncioBridge | None = None
        self.llm = None
        #: vLLM's scheduler statistics, kept current by a stat logger of its own.
        self.scheduler = compat.SchedulerLoad()

    def load(self, slots: int) -> EngineLoad:
        """The engine's load now, as its scheduler last reported it."""
        now = self.scheduler
        return EngineLoad(slots=slots, running=now.running, waiting=now.waiting,
                          kv_cache_usage=now.kv_cache_usage, preemptions=now.preemptions)

    def engine_args(self):
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(
            model=self.model_path,
            dtype=engine_dtype(self.cfg.dtype),
            max_num_seqs=self.cfg.max_num_seqs,
            kv_cache_memory_bytes=kv_cache_bytes(self.cfg, self.model_path),
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            enforce_eager=self.cfg.enforce_eager,
            logprobs_mode="processed_logprobs",
            max_logprobs=self.max_logprobs,
            weight_transfer_config={"backend": self.weight_backend()},
            worker_extension_cls="rlflow.services.rollout.vllm_lora_worker.WorkerExtension",
            seed=self.seed,
            disable_log_stats=True,
            enable_prefix_caching=False,
            # An evaluation's requests go first (`complete`), so that it reads its version quickly.
            scheduling_policy="priority",
            # A request's own generator is wound back when a prompt's chunk is computed without a
            # token to keep, which a CPU generator cannot do (vLLM's engine dies: "CPU Generator does not
            # use offset"): seeded requests get their prompts computed whole.
            enable_chunked_prefill=False if self.seeded else None,
            # Whole prompts: a step then takes the longest (vLLM refuses a smaller budget without chunks).
            max_num_batched_tokens=max(UNCHUNKED_BATCH_TOKENS, longest(self.model_path)) if self.seeded else None,
            **self.lora_args(),
        )

    def lora_args(self) -> dict[str, Any]:
        """vLLM's LoRA settings: an adapter of up to `lora_rank` in each of `lora_slots` slots."""
        if not self.lora_rank:
            return {}
        return {"enable_lora": True, "max_lora_rank": compat.lora_max_rank(self.lora_rank),
                "max_loras": self.lora_slots, "max_cpu_loras": self.lora_slots}

    def weight_backend(self) -> str:
        """The weight-transfer backend this engine starts with (see `__init__`)."""
        if self.weights is None:
            from vllm.platforms import current_platform

            self.weights = NCCL if current_platform.is_cuda() else BACKEND
        return self.weights

    def start_blocking(self) -> None:
        """Start vLLM (its engine core is a process of its own); blocks."""
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if hasattr(os, "sched_getaffinity") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM-CPU binds its threads to a whole NUMA node by default; keep
            # it on the cores placement gave this replica.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_ranges(sorted(os.sched_getaffinity(0)))
        # Idle OpenMP threads sleep instead of spinning, so that a role
        # sharing a core with the engine still gets it when the engine waits.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

        self.bridge = AsyncioBridge()
        args = self.engine_args()
        cpu = current_platform.is_cpu()
        # Set for the call that makes the config and spawns the engine core, unless set already.
        env = {name: value for name, value, wanted in (
            (MULTIPROCESSING_ENV, "0", cpu and self.cfg.tensor_parallel_size == 1),
            (COMPILE_ENV, "1", cpu and self.cfg.enforce_eager),
        ) if wanted and name not in os.environ}

        async def create():
            # Without vLLM's own loggers: its scheduler statistics reach the
            # heartbeats through this one alone.
            os.environ.update(env)
            try:
                return AsyncLLM.from_engine_args(args, stat_loggers=[compat.load_logger(self.scheduler)])
            finally:
                for name in env:
                    os.environ.pop(name, None)

        self.llm = asyncio.run_coroutine_threadsafe(create(), self.bridge.loop).result()

    def close(self) -> None:
        """Stop vLLM (on its own loop, so that its output task ends cleanly)."""
        if self.llm is not None and self.bridge is not None:
            from vllm.platforms import current_platform

            llm, self.llm = self.llm, None
            grace = CPU_EXIT_GRACE_S if current_platform.is_cpu() else None

            async def stop() -> None:
                llm.shutdown(timeout=grace)

            asyncio.run_coroutine_threadsafe(stop(), self.bridge.loop).result(timeout=60)
        if self.bridge is not None:
            self.bridge.close()
            self.bridge = None

    async def call(self, make: Callable[[], Awaitable[Any]]) -> Any:
        """Await `make()` on vLLM's loop; vLLM's `EngineDeadError` once its engine core has died."""
        assert self.bridge is not None, "start the backend first"
        llm = self.llm
        return await self.bridge.run(lambda: unless_dead(make(), lambda: llm is not None and llm.errored))

    async def set_version(self, version: int) -> None:
        """Label the weights held now (tokens generated with them carry it)."""
        llm = self.llm
        await self.call(lambda: llm.update_weight_version(str(version)))

    async def join_weights(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0) -> None:
        """Join the trainer's gloo weight group (returns once all have joined, or fails after `timeout_s`)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        llm = self.llm
        request = WeightTransferInitRequest(
            init_info={"host": host, "port": port, "rank": rank, "world_size": world_size, "timeout_s": timeout_s}
        )
        await self.call(lambda: llm.init_weight_transfer_engine(request))

    async def join_nccl(self, transfer: WeightsNccl) -> None:
        """Join the trainer's NCCL weight group with every worker (returns once all have joined)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        llm = self.llm
        request = WeightTransferInitRequest(init_info=nccl_init_info(transfer))
        await self.call(lambda: llm.init_weight_transfer_engine(request))

    async def update(self, version: int, layout: list[ParamSpec], nbytes: int, *, kv: str | None = None,
                     bucket_bytes: int = 0) -> None:
        """Pause with requests kept, receive and load `version` (in pieces of at
        most `bucket_bytes`, as the trainer sends them), resume.

        `kv` (default: the config's `kv_on_update`): "keep" the KV cache of
        requests in flight or "recompute" it under the new weights."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self.weight_backend() == NCCL:
            update = nccl_update_info(layout)
        else:
            update = gloo_update_info(layout, nbytes, bucket_bytes)
        llm = self.llm
        clear = (kv or self.cfg.kv_on_update) == "recompute"
        await self.call(lambda: llm.pause_generation(mode="keep", clear_cache=clear))
        try:
            await self.call(llm.start_weight_update)
            await self.call(lambda: llm.update_weights(WeightTransferUpdateRequest(update_info=update)))
            await self.call(lambda: llm.finish_weight_update(weight_version=str(version)))
        finally:
            await self.call(llm.resume_generation)

    async def load_adapter(self, info: dict[str, Any], *, pause: bool = False, kv: str | None = None,
                           version: int | None = None) -> str:
        """Hand a LoRA adapter to every worker (`vllm_lora_worker.WorkerExtension.
        rlflow_load_adapter`, which takes it from the weight group, a file or
        zeros as `info` says); its checksum as received. With `pause`: between
        two engine steps, requests kept (their KV cache as `kv` says, default
        the config's `kv_on_update`), and the tokens after it labelled `version`."""
        llm = self.llm
        if pause:
            clear = (kv or self.cfg.kv_on_update) == "recompute"
            await self.call(lambda: llm.pause_generation(mode="keep", clear_cache=clear))
        try:
            checksums = await self.call(lambda: llm.collective_rpc("rlflow_load_adapter", args=(info,)))
            if version is not None:
                await self.call(lambda: llm.update_weight_version(str(version)))
        finally:
            if pause:
                await self.call(llm.resume_generation)
        # Every tensor-parallel worker takes the whole adapter: they must agree.
        return checksums[0] if len(set(checksums)) == 1 else "workers disagree: " + ", ".join(checksums)

    async def retire_adapter(self, lora_id: int) -> None:
        """Let go of adapter `lora_id` once no request uses it (requests on it
        may be ending: their aborts reach vLLM before it is let go of)."""
        llm = self.llm

        async def retire() -> None:
            if self._users.get(lora_id, 0):
                self._retired.add(lora_id)
            else:
                await llm.collective_rpc("rlflow_unload_adapter", args=(lora_id,))

        await self.call(retire)

    def _release(self, lora_id: int) -> None:
        """Asyncio side: a request on adapter `lora_id` has ended (after vLLM's
        abort, if it was cancelled); the last one lets go of a retired adapter."""
        self._users[lora_id] -= 1
        if self._users[lora_id] == 0:
            del self._users[lora_id]
            if lora_id in self._retired:
                self._retired.discard(lora_id)
                task = asyncio.get_running_loop().create_task(
                    self.llm.collective_rpc("rlflow_unload_adapter", args=(lora_id,)))
                self._unloading.add(task)
                task.add_done_callback(self._unloading.discard)

    async def generate(
        self,
        prompt_ids: list[int],
        n: int,
        temperature: float,
        *,
        max_tokens: int | None = None,
        ignore_eos: bool = False,
        first_token: trio.Event | None = None,
        lora_id: int = 0,
        priority: int = 0,
        seed: int | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ):
        """The final RequestOutput of one request with `n` samples (`ignore_eos`:
        run to `max_tokens` without changing the sampling distribution;
        `first_token` is set once every sample has its first token; `lora_id`:
        under that adapter, 0: the base alone; `priority`: lower goes first;
        `seed`: the request's own random stream, sample i's seed + i (None: the engine's,
        shared with whatever else it runs); `on_tokens`: called in trio with the first sample's
        tokens so far after each engine step that adds to them)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=self.cfg.top_p if temperature > 0 else 1.0,
            max_tokens=max_tokens or self.cfg.max_tokens,
            ignore_eos=ignore_eos,
            logprobs=0 if temperature > 0 else None,
            # Only the final output, unless someone waits for the first tokens or follows them.
            output_kind=RequestOutputKind.FINAL_ONLY if first_token is None and on_tokens is None
            else RequestOutputKind.CUMULATIVE,
            detokenize=False,  # the roles downstream read token ids
            seed=seed,
        )
        request_id = uuid.uuid4().hex
        llm = self.llm
        trio_token = trio.lowlevel.current_trio_token()

        lora = lora_request(lora_id) if lora_id else None

        async def run():
            final, told = None, first_token is None
            if lora_id:
                self._users[lora_id] = self._users.get(lora_id, 0) + 1
            try:
                async for out in llm.generate({"prompt_token_ids": list(prompt_ids)}, params, request_id,
                                              lora_request=lora, priority=priority):
                    final = out
                    if not told and len(out.outputs) == n and all(c.token_ids for c in out.outputs):
                        trio_token.run_sync_soon(first_token.set)
                        told = True
                    if on_tokens is not None and out.outputs and not out.finished:
                        trio_token.run_sync_soon(on_tokens, list(out.outputs[0].token_ids))
            finally:
                if lora_id:
                    self._release(lora_id)
            return final

        return await self.call(run)

    async def prompt_logprobs(self, ids: list[int], k: int) -> list:
        """vLLM's log-probabilities of each token of `ids` given the ones before
        (temperature 1: prompt tokens skip the sampling processors), with the
        `k` most likely tokens at each position: one dict {token id: Logprob}
        per position, None at the first."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=1, prompt_logprobs=k, output_kind=RequestOutputKind.FINAL_ONLY,
                                detokenize=False)
        request_id = uuid.uuid4().hex
        llm = self.llm

        async def run():
            final = None
            async for out in llm.generate({"prompt_token_ids": list(ids)}, params, request_id):
                final = out
            return final.prompt_logprobs

        return await self.call(run)


def engine_dtype(setting: str) -> str:
    """vLLM's dtype for the config's `dtype` (see `VllmRollout.dtype`: "auto" is rlflow's, on a CPU)."""
    if setting != "auto":
        return setting
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "auto"
    return "bfloat16" if compat.cpu_multiplies_bf16() else "float32"


#: The tokens a step of the engine takes when prompts are computed whole (`VllmBackend.seeded`), at least
#: (vLLM's own budget on a CPU with chunks).
UNCHUNKED_BATCH_TOKENS = 4096


def longest(model_path: str) -> int:
    """The longest sequence the model at `model_path` takes (its positions)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).get_text_config().max_position_embeddings


def kv_cache_bytes(cfg: VllmRollout, model_path: str) -> int | None:
    """The KV cache a replica asks vLLM for: the config's, or ("auto") room for every slot at the model's
    longest sequence, up to a quarter of this machine's memory (None on a GPU: vLLM sizes it there from
    gpu_memory_utilization)."""
    if cfg.kv_cache_bytes != "auto":
        return cfg.kv_cache_bytes
    from transformers import AutoConfig
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    model = AutoConfig.from_pretrained(model_path).get_text_config()
    heads = model.num_attention_heads
    head_dim = getattr(model, "head_dim", None) or model.hidden_size // heads
    kv_heads = getattr(model, "num_key_value_heads", None) or heads
    dtype = engine_dtype(cfg.dtype)
    per_token = 2 * model.num_hidden_layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    want = cfg.max_num_seqs * model.max_position_embeddings * per_token
    return max(16 << 20, min(want, psutil.virtual_memory().total // 4))


def lora_request(lora_id: int):
    """vLLM's handle of adapter `lora_id` (which reaches it from memory, never from `ADAPTER_PATH`)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"rlflow-adapter-{lora_id}", lora_int_id=lora_id, lora_path=ADAPTER_PATH)


def gloo_update_info(layout: list[ParamSpec], nbytes: int, bucket_bytes: int) -> dict[str, Any]:
    """`update_info` of one update for rlflow's gloo backend (`vllm_worker.GlooUpdateInfo`)."""
    return {
        "names": [p.name for p in layout],
        "dtypes": [p.dtype for p in layout],
        "shapes": [list(p.shape) for p in layout],
        "offsets": [p.offset for p in layout],
        "nbytes": nbytes,
        "bucket_bytes": bucket_bytes,
    }


def nccl_init_info(transfer: WeightsNccl) -> dict[str, Any]:
    """`init_info` for vLLM's `nccl` backend (its `NCCLWeightTransferInitInfo`):
    the rendezvous, this replica's first NCCL rank (vLLM adds each worker's
    tensor-parallel rank), and the packed transfer the trainer sends."""
    ranks = nccl_ranks(transfer)
    return {
        "master_address": transfer.host,
        "master_port": transfer.port,
        "rank_offset": ranks.offset,
        "world_size": ranks.world,
        "packed": True,
        "packed_buffer_size_bytes": nccl_chunk_bytes(transfer),
        "packed_num_buffers": NCCL_BUFFERS,
    }


def nccl_update_info(layout: list[ParamSpec]) -> dict[str, Any]:
    """`update_info` of one update for vLLM's `nccl` backend (its
    `NCCLWeightTransferUpdateInfo`): the parameters in the order they are sent."""
    return {
        "names": [p.name for p in layout],
        "dtype_names": [p.dtype for p in layout],
        "shapes": [list(p.shape) for p in layout],
    }
