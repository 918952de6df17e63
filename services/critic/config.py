"""The critic role's tables: `[roles.critic]` and its engines (simulated, torch), the config's
`RolesConfig.critic`."""

from __future__ import annotations

from typing import Any, Literal, Union

from rlflow.config.base import Fraction, NonNegFloat, NonNegInt, PosFloat, PosInt, RoleTable, Table
from rlflow.config.errors import ConfigError
from rlflow.config.trainer import SimTrainer, TorchTrainer
from rlflow.roles import BY_NAME


class SimCritic(Table, tag_field="kind", tag="sim", frozen=True):
    """A simulated critic: a fixed time per token for its forward pass and for its step; its values are
    0, so the advantages it attaches are the discounted rewards."""

    forward_s_per_token: NonNegFloat = 0.0
    """Time to compute the value of one response token."""
    step_s_per_token: NonNegFloat = 0.0
    """Time to train on one response token (forward, backward and optimizer step together)."""
    step_overhead_s: NonNegFloat = 0.0
    """Fixed time per optimizer step."""


class TorchCritic(Table, tag_field="kind", tag="torch", frozen=True):
    """A Hugging Face model with a scalar value head (its token-classification class with one label),
    trained by regression on the returns with a clipped value loss, sharded over the critic's ranks
    with FSDP2 as the trainer is."""

    model: str = "policy"
    """Where the critic starts: "policy" (the policy's starting weights, with a new value head that
    outputs 0) or a directory (a critic saved by an earlier run, or another model with the policy's
    tokenizer)."""
    lr: PosFloat = 1e-4
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: NonNegFloat = 0.0
    """AdamW weight decay."""
    grad_clip: PosFloat = 1.0
    """Clip the gradient's global norm to this."""
    value_clip: NonNegFloat = 0.5
    """PPO's clipped value loss: a new value may move at most this far from the value attached to the
    sample before its loss stops pulling it (0: no clipping)."""
    micro_batch_tokens: PosInt = 8192
    """Tokens per forward / backward pass (samples are packed up to this)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameters and compute."""
    mixed_precision: bool | Literal["auto"] = False
    """On a CPU, the forward and backward passes in bfloat16 over weights kept in `dtype`, as the
    torch trainer's setting of that name (auto: where the CPU multiplies bf16 itself)."""


CriticEngine = Union[SimCritic, TorchCritic]


class CriticRole(RoleTable, kw_only=True, frozen=True):
    """The role that learns a value function: per batch, on its way to the trainer, it computes each
    response token's value with its current weights, attaches GAE advantages and returns, sends the
    batch on, then trains itself on it, while the trainer takes its own step."""

    uses_policy = True
    renamed = {"max_staleness": ("max_steps_owed", "one name per meaning: run.max_staleness is the policy's bound")}

    pool: str
    """Name of the pool its replicas run on."""
    replicas: PosInt = 1
    """Critic ranks: one model sharded across them with FSDP2 (as the trainer's ranks); rank 0 takes
    the stream."""
    engine: CriticEngine = SimCritic()
    """The value model and its settings."""
    gamma: Fraction = 1.0
    """Discount of GAE."""
    lam: Fraction = 0.95
    """GAE's lambda: 0 is the one-step TD error, 1 the return minus the value (Monte Carlo)."""
    max_steps_owed: NonNegInt = 1
    """Steps the critic may owe: it computes values for new samples while at most this many of its
    full batches (`run.batch_size` groups each) wait for its step (0: it steps as soon as a batch is
    full, before computing more values)."""
    warmup_steps: NonNegInt = 0
    """The first this many steps train the critic while the actor does not move (the trainer takes
    them without changing its weights, so the values fit the starting policy first)."""

    def holds_policy(self, step: int) -> bool:
        """The warm-up: in its first `warmup_steps` steps only the critic learns."""
        return step < self.warmup_steps

    def attaches(self) -> frozenset[str]:
        """Its values, GAE advantages and returns, and the version that computed them (a simulated critic's
        values are 0, so its advantages are the discounted rewards: real all the same)."""
        return frozenset(BY_NAME["critic"].attaches)

    def check(self, config: Any) -> None:
        """The trainer uses the advantages this role attaches; a KL penalty in the reward, which the critic
        folds into its returns, is to the teacher's model (the critic cannot score a LoRA adapter's base);
        a simulated critic is one rank."""
        trainer = config.roles.trainer.engine
        if isinstance(trainer, TorchTrainer) and trainer.advantage != "gae":
            raise ConfigError("roles.trainer.engine.advantage", trainer.advantage,
                              "the trainer would ignore the critic's advantages: use 'gae' with [roles.critic]")
        if (isinstance(trainer, TorchTrainer) and trainer.kl_coef > 0 and trainer.kl_in == "reward"
                and trainer.lora is not None and trainer.lora.reference == "base"):
            raise ConfigError("roles.trainer.engine.kl_in", trainer.kl_in,
                              "with [roles.critic] a KL penalty in the reward is folded into the returns by the "
                              "critic, which cannot score the base of the trainer's LoRA adapter "
                              "(lora.reference = 'base'): use kl_in = 'loss'")
        if isinstance(self.engine, SimCritic) and self.replicas > 1:
            raise ConfigError("roles.critic.replicas", self.replicas,
                              "the simulated critic is one rank (lower its times per token to model more)")
        if isinstance(trainer, SimTrainer) and trainer.inline_critic_s_per_token > 0:
            raise ConfigError("roles.trainer.engine.inline_critic_s_per_token", trainer.inline_critic_s_per_token,
                              "a critic in the trainer's process and a critic role are two layouts of one critic: "
                              "choose one")
