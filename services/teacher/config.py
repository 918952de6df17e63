"""The teacher role's tables: `[roles.teacher]` and its engines (simulated, a frozen model), the
config's `RolesConfig.teacher`."""

from __future__ import annotations

from typing import Any, Literal, Union

from rlflow.config.base import NonNegFloat, NonNegInt, PosInt, StartedRole, Table
from rlflow.config.errors import ConfigError


class SimTeacher(Table, tag_field="kind", tag="sim", frozen=True):
    """A simulated teacher: a fixed time per scored token."""

    s_per_token: NonNegFloat = 0.0
    """Time to score one response token."""


class ModelTeacher(Table, tag_field="kind", tag="model", frozen=True):
    """A frozen Hugging Face model that scores every response token as batches
    stream past: the log-probability of the sampled token, and optionally its
    own top-k tokens, at the rollout's sampling temperature. The trainer reads
    them for on-policy distillation and for a KL penalty."""

    model: str = "policy"
    """Model directory of the teacher ("policy": a frozen copy of the policy's starting weights, the
    reference of a KL penalty). It must use the policy's tokenizer."""
    backend: Literal["torch", "vllm"] = "torch"
    """torch: a forward pass; vllm: vLLM's prompt log-probabilities (measured slower on CPU; see README)."""
    top_k: NonNegInt = 0
    """Also send the teacher's k most likely tokens and their log-probabilities at each position (0: none)."""
    batch_tokens: PosInt = 8192
    """Tokens (prompt and response, padded) per forward pass."""
    temperature: NonNegFloat | None = None
    """Temperature the log-probabilities are taken at (default: the rollout's); it must equal the rollout's."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations."""
    kv_cache_bytes: PosInt = 256 << 20
    """KV cache size of the vllm backend on CPU."""

    def check_vocabulary(self, vocab: int | None, key: str) -> None:
        """Refuses a `top_k` beyond the model's vocabulary (`vocab`; None: the model does not say)."""
        if vocab is not None and self.top_k > vocab:
            raise ConfigError(f"{key}.top_k", self.top_k,
                              f"asks for more tokens than the teacher's vocabulary has ({vocab})")


TeacherEngine = Union[SimTeacher, ModelTeacher]


class TeacherRole(StartedRole, frozen=True):
    """The role that adds teacher / reference log-probabilities."""

    uses_policy = True

    engine: TeacherEngine = SimTeacher()
    """The scoring model."""

    def attaches(self) -> frozenset[str]:
        """A scoring model's log-probabilities, and its top k where it sends them (a simulated teacher's
        are made up)."""
        if not isinstance(self.engine, ModelTeacher):
            return frozenset()
        topk = {"teacher_topk_ids", "teacher_topk_logprobs"} if self.engine.top_k > 0 else set()
        return frozenset({"teacher_logprobs", *topk})

    def check(self, config: Any) -> None:
        """A scoring model sends what the trainer's distillation reads (its top k), scored at the
        temperature the rollout samples at."""
        trainer = config.roles.trainer.engine
        if not isinstance(self.engine, ModelTeacher):
            return
        if getattr(trainer, "distill_coef", 0) > 0 and trainer.distill == "topk" and self.engine.top_k == 0:
            raise ConfigError("roles.teacher.engine.top_k", 0,
                              "must be at least 1 for roles.trainer.engine.distill = 'topk'")
        rollout_t = getattr(config.roles.rollout.engine, "temperature", None)
        if self.engine.temperature is not None and rollout_t is not None and self.engine.temperature != rollout_t:
            raise ConfigError(
                "roles.teacher.engine.temperature", self.engine.temperature,
                f"must equal the rollout's sampling temperature ({rollout_t:g}): the teacher scores the distribution "
                "the student samples from",
            )
