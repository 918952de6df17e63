"""The trainer role's tables: `[roles.trainer]`, its engines (simulated, torch) and LoRA."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from msgspec import Meta

from rlflow.config.base import Fraction, NonNegFloat, NonNegInt, PosFloat, PosInt, RoleTable, Table
from rlflow.config.errors import ConfigError
from rlflow.roles import ROLES, spoken

#: A checkpoint's LoRA adapter, in PEFT's format, is this folder of it.
ADAPTER_DIR = "adapter"


class SimTrainer(Table, tag_field="kind", tag="sim", frozen=True):
    """A simulated trainer: a fixed time per trained token, and a weight
    payload of `weights_bytes` that really crosses the wire to the rollout."""

    s_per_token: NonNegFloat = 1e-5
    """Time to train on one token (forward, backward and optimizer step together)."""
    step_overhead_s: NonNegFloat = 0.0
    """Fixed time per optimizer step."""
    weights_bytes: NonNegInt = 1 << 20
    """Size of the weights published after each step."""
    checkpoint_every: NonNegInt = 0
    """Write a checkpoint (the run state; there are no weights) every this many steps, so that a
    simulated run resumes (0: none)."""
    inline_critic_s_per_token: NonNegFloat = 0.0
    """Time per token of a critic's forward pass and step done in this process before each actor step
    (the layout of a one-worker design, to compare with a critic role on its own pool in
    bench/critic.py; 0: none)."""


class Lora(Table, frozen=True):
    """A LoRA adapter (the `peft` library) trained on the frozen base model:
    the optimizer holds only the adapter, weight updates carry only its
    tensors, and the rollout serves the base with the adapter (vLLM's LoRA)."""

    rank: Annotated[int, Meta(ge=1, le=512)] = 16
    """The adapter's rank r."""
    alpha: PosFloat = 32.0
    """The update is scaled by alpha / rank (PEFT's lora_alpha)."""
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Dropout on the adapter's input while training (PEFT's lora_dropout); it makes the trainer's
    log-probabilities noisy against the rollout's, so 0 is the default."""
    targets: Annotated[tuple[str, ...], Meta(min_length=1)] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Names of the linear modules to adapt (PEFT's target_modules; vLLM serves adapters of linear layers)."""
    adapter_update: Literal["in_place", "per_request"] = "in_place"
    """How the rollout takes each new adapter. in_place: it replaces the adapter served between two decode
    steps, as whole weights do (requests in flight go on with it; their later tokens carry the new
    version). per_request: up to max_staleness + 1 versions stay loaded and each request finishes under
    the version it started with (every token of a sample has one version); a request still running when
    its version falls out of that window is started again on the newest."""
    reference: Literal["base", "teacher"] = "base"
    """The reference of a KL penalty (kl_coef > 0). base: the base model with the adapter turned off, in
    the trainer's own process (no teacher role, no second copy of the model); teacher: the teacher role's
    log-probabilities, as without LoRA."""
    save_merged: bool = False
    """Checkpoints also hold the base with the adapter merged in, as a Hugging Face model directory (the
    adapter alone, in PEFT's format, is always saved, under adapter/)."""
    transfer: Literal["group", "zmq"] = "group"
    """How each adapter version reaches the rollout. group: broadcast over the run's weight group (gloo on
    CPUs, NCCL on GPUs), as whole weights are; zmq: every replica fetches it from trainer rank 0's ZeroMQ
    weight server (SPEC.md, *Weights*) before it pauses generation to load it: nothing but ZeroMQ on either
    side, and no group to make again when a replica is replaced (an adapter is small; the group is faster
    for large ones)."""


class TorchTrainer(Table, tag_field="kind", tag="torch", frozen=True):
    """A torch trainer on the Hugging Face class of the rollout's model: GRPO
    or RLOO advantages, a PPO-clipped objective with off-policy corrections."""

    lr: PosFloat = 1e-4
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: NonNegFloat = 0.0
    """AdamW weight decay."""
    warmup_steps: NonNegInt = 0
    """Linear learning-rate warm-up."""
    lr_decay: Literal["none", "linear", "cosine"] = "none"
    """After the warm-up, hold the learning rate (none) or bring it down, linearly or along a cosine,
    to lr_final x lr at the run's last step (run.steps, or lr_decay_steps)."""
    lr_final: Fraction = 0.0
    """With lr_decay: the learning rate at the last step, as a fraction of lr."""
    lr_decay_steps: NonNegInt = 0
    """With lr_decay: the steps the decay is spread over (0: run.steps). A run cut short of its
    schedule (a benchmark of a run's first steps) sets the schedule's whole length here."""
    grad_clip: PosFloat = 1.0
    """Clip the gradient's global norm to this."""
    advantage: Literal["grpo", "rloo", "gae"] = "grpo"
    """grpo: (r - mean) / std within the group; rloo: r minus the mean of the others; gae: the per-token
    advantages the critic role attaches (PPO with a learned value function; needs [roles.critic])."""
    normalize_std: bool = True
    """GRPO: divide by the group's reward standard deviation."""
    skip_uniform_groups: bool = True
    """Leave out groups whose rewards are all equal (no signal, only noise)."""
    loss_norm: Literal["trained_tokens", "batch_tokens", "sequences"] = "batch_tokens"
    """What the policy loss's sum over tokens is divided by. batch_tokens: every response token of the
    batch, groups without signal included (DAPO's token mean, TRL's default: a batch with less signal
    moves the policy less); trained_tokens: the tokens trained on (groups without signal left out: every
    step as large, however little signal it had); sequences: each sample's token mean, averaged over
    the batch's samples (GRPO's)."""
    clip_low: Fraction = 0.2
    """PPO clip range below 1."""
    clip_high: NonNegFloat = 0.28
    """PPO clip range above 1."""
    decoupled: bool = False
    """false: clip the ratio to the behaviour policy that generated each token (PPO's trust region,
    around the samples, however many versions old). true: decoupled PPO (Hilton et al., 2022), clip
    against a proximal policy (the trainer's weights before the step) and weigh each token by
    proximal / behaviour, as `correction` says. With one optimizer step per batch, as here, the
    proximal ratio is 1 and nothing is clipped: stale samples move the policy as far as fresh ones."""
    objective: Literal["ppo", "gspo", "cispo"] = "ppo"
    """The policy loss. ppo: the clipped surrogate per token. gspo (Zheng et al., 2025, Group Sequence
    Policy Optimization): the ratio is the sample's geometric mean of its token ratios, clipped per
    sample (the paper clips at 3e-4 below and 4e-4 above, with loss_norm = "sequences"). cispo
    (MiniMax-M1, 2025): the clipped ratio weighs every token's log-probability without a gradient of
    its own, so no token's gradient is dropped by the clip (the paper leaves clip_low wide)."""
    correction: Literal["none", "truncate", "mask"] = "none"
    """The correction of the gap between the engine that sampled a token and the trainer (a different
    kernel, precision or version), by the behaviour weight w = proximal / behaviour. truncate (TIS, Yao
    et al., 2025, "Your efficient RL framework secretly brings you off-policy RL training"; needs
    decoupled): each token weighs min(w, correction_high). mask (masked importance sampling; with a
    lower bound, IcePop of Ring-1T, 2025): tokens whose w lies outside [correction_low,
    correction_high] are left out of the loss, the others weigh w if decoupled, else 1. none: no
    weight (decoupled: every token weighs 1)."""
    correction_level: Literal["token", "sequence"] = "token"
    """token: each token's own weight; sequence: one weight per sample, the geometric mean of its token
    weights (a whole sample truncated or masked at once)."""
    correction_low: NonNegFloat = 0.0
    """mask: the least weight kept (0: no lower bound; IcePop keeps [0.5, 2])."""
    correction_high: PosFloat = 2.0
    """truncate: the weights' cap; mask: the most weight kept."""
    overlong_buffer: NonNegInt = 0
    """DAPO's soft over-long punishment (Yu et al., 2025): a response longer than the rollout's
    max_tokens minus this many tokens loses overlong_penalty x (its tokens over that) / this from its
    reward, the whole penalty at max_tokens (0: none)."""
    overlong_penalty: NonNegFloat = 1.0
    """The most reward the over-long punishment takes."""
    overlong_filter: bool = False
    """DAPO's over-long filtering: responses cut at max_tokens are left out of the loss (their group's
    advantages are still computed with them)."""
    micro_batch_tokens: PosInt = 8192
    """Tokens per forward / backward pass (samples are packed up to this)."""
    share_prompts: bool = True
    """The samples of one prompt in one row of a pass: the prompt through the model once, each
    response attending to it and to its own tokens (a block mask). The same loss and gradient as a
    row per sample, over fewer tokens: GRPO's group of n samples passes its prompt once, not n times.
    A response joins the row only where that costs less than a row of its own (a longer row costs
    more attention): long answers to a short prompt keep a row each. Under sdpa attention without
    sliding windows; other models keep a row per sample (false: a row per sample always)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameters and compute."""
    mixed_precision: bool | Literal["auto"] = False
    """On a CPU, run the forward and backward passes in bfloat16 over weights kept in `dtype`
    (torch.autocast; log-probabilities, loss and optimizer in float32): about 1.6x faster a step
    where the CPU multiplies bf16 matrices itself (AMX, AVX512-BF16), slower where it does not.
    auto: where it does. On CUDA the passes are always bf16 (FSDP's mixed precision)."""
    checkpoint_every: NonNegInt = 0
    """Write a checkpoint every this many steps (0: only at the end)."""
    bucket_bytes: PosInt = 256 << 20
    """Weights go to the rollout in pieces of at most this many bytes (cut at parameter boundaries; a
    larger parameter goes alone): the trainer ranks gather one piece while rank 0 broadcasts the last,
    so a send holds two pieces, not the model. A receiver older than this setting needs it at least
    the model's size."""
    kl_coef: NonNegFloat = 0.0
    """Weight of a KL penalty to the teacher role's model (a frozen reference; 0: none)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """k1: log(p / ref); k3: ref / p - 1 - log(ref / p) (unbiased, never negative)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Add the KL penalty as a loss term, or subtract it from each sample's reward."""
    distill_coef: Fraction = 0.0
    """Weight of on-policy distillation towards the teacher role's model: 0 is RL alone, 1 distillation
    alone, in between a mix of the two objectives."""
    distill: Literal["sampled", "topk"] = "sampled"
    """sampled: the reverse KL at the sampled token as a per-token advantage; topk: a loss over the
    teacher's top-k tokens (roles.teacher.engine.top_k > 0)."""
    lora: Lora | None = None
    """Train a LoRA adapter on the frozen base instead of the whole model, e.g. {rank = 16, alpha = 32}
    (none: full fine-tuning)."""
    advantage_norm: Literal["returns", "whiten", "none"] = "returns"
    """advantage = "gae": how the critic's per-token advantages are scaled over the step's batch. returns:
    less their mean, over the spread of the batch's returns (a critic that fits well leaves small advantages
    small; a batch whose returns all agree trains on nothing); whiten: mean 0, std 1 (what most PPO code
    does: a well-fitted critic's residuals, noise, are blown up to unit size and the policy follows them);
    none: as the critic made them."""

    def reads(self) -> list[tuple[str, Any, str]]:
        """(key, value, column): the columns of `SampleBatch` that its settings read, each with the setting
        that reads it (GAE the per-token advantages; a KL penalty, but to the base of a LoRA adapter, and
        distillation a reference model's log-probabilities; distillation over the top k their top k). The
        config is checked against them (`TrainerRole.check`), and each batch the trainer takes."""
        base_reference = self.lora is not None and self.lora.reference == "base"
        out: list[tuple[str, Any, str]] = []
        if self.advantage == "gae":
            out.append(("advantage", "gae", "token_advantages"))
        if self.advantage == "gae" and self.advantage_norm == "returns":
            out.append(("advantage_norm", "returns", "returns"))
        if self.kl_coef > 0 and not base_reference:
            out.append(("kl_coef", self.kl_coef, "teacher_logprobs"))
        if self.distill_coef > 0:
            out.append(("distill_coef", self.distill_coef, "teacher_logprobs"))
        if self.distill_coef > 0 and self.distill == "topk":
            out += [("distill", "topk", "teacher_topk_ids"), ("distill", "topk", "teacher_topk_logprobs")]
        return out


TrainerEngine = Union[SimTrainer, TorchTrainer]


class TrainerRole(RoleTable, kw_only=True, frozen=True):
    """The role that trains the policy."""

    uses_policy = True
    renamed = {"engine.tis_cap": ("engine.correction_high",
                                  "with correction = 'truncate' and decoupled = true; 0 was correction = 'none'")}

    pool: str
    """Name of the pool its replicas run on."""
    replicas: PosInt = 1
    """Trainer ranks: one model sharded across them with FSDP2 (gloo on CPUs, NCCL on GPUs, a GPU each);
    rank 0 takes the stream and deals each step's samples to the ranks by tokens."""
    engine: TrainerEngine = SimTrainer()
    """The training engine and its settings."""

    def check(self, config: Any) -> None:
        """The terms of its loss have a role that attaches the columns they read (`TorchTrainer.reads`);
        neither GAE nor distillation beside the signal filter, whose groups of equal rewards they would
        still learn from."""
        engine = self.engine
        if not isinstance(engine, TorchTrainer):
            return
        if config.run.filter == "signal" and engine.advantage == "gae":
            raise ConfigError("run.filter", config.run.filter, "the critic's advantages (advantage = 'gae') are not "
                              "group-relative: a group with equal rewards still teaches; use filter = 'none'")
        if config.run.filter == "signal" and engine.distill_coef > 0:
            raise ConfigError("run.filter", config.run.filter, "with distillation (distill_coef > 0) a group with "
                              "equal rewards still learns from the teacher; use filter = 'none'")
        attached = frozenset().union(*(role.attaches() for _, role in config.role_items()))
        for key, value, column in engine.reads():
            if column not in attached:
                by = spoken(tuple(f"[roles.{role.name}]" for role in ROLES if column in role.attaches))
                raise ConfigError(f"roles.trainer.engine.{key}", value,
                                  f"reads the column {column}, which no role of this config attaches ({by} does, "
                                  "unless its engine is simulated and makes them up)")
