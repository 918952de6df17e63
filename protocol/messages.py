"""Every message that crosses a process boundary in rlflow.

Messages are frozen msgspec Structs encoded as msgpack arrays whose first
element is an integer tag. Bulk arrays are `Tensor` fields, which travel as
raw frames beside the header (see `tensors.py` and SPEC.md).

Four channels, one union each:

* data plane (`DataMessage`): columnar sample batches, streamed PUSH ->
  PULL from role to role;
* control plane (`ControlMessage`): between each service (DEALER) and the
  controller (ROUTER);
* weights (`WeightsMessage`): a weight payload served by the trainer when
  the weight transport is ZeroMQ;
* environment (`EnvMessage`): a rollout replica's requests to the env role
  (reset an episode, take one step of it) and their replies (DEALER ->
  ROUTER), when the run has environments.

Schema evolution (see SPEC.md): fields are only ever appended, always with a
default; a field never changes type; a tag is never reused. Breaking any of
these bumps `SCHEMA_VERSION`, and peers of different versions refuse each
other's messages.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

from .checks import validate
from .tensors import Tensor

#: Incompatible changes bump this; compatible ones (appended fields with
#: defaults, new tags) do not. 2: `Hello` and `Heartbeat` typed (no string
#: maps of details and counters), unused fields and `Pause` / `Resume` gone.
SCHEMA_VERSION = 2

NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]


class Role(enum.IntEnum):
    """Who speaks. The value is what goes on the wire."""

    CONTROLLER = 0
    ROLLOUT = 1
    REWARD = 2
    TEACHER = 3
    TRAINER = 4
    ENV = 5
    CRITIC = 6

    @property
    def label(self) -> str:
        return self.name.lower()


class FinishReason(enum.IntEnum):
    """Why a response ended."""

    STOP = 0  #: a stop token or string
    LENGTH = 1  #: the length cap
    ABORT = 2  #: aborted (e.g. too stale to be trained on)
    ERROR = 3  #: the engine failed on this request
    TURNS = 4  #: an episode reached its most turns (`roles.env.max_turns`) before it was done


class Stage(enum.IntEnum):
    """Columns of `SampleBatch.stamps`: when a sample passed each stage.

    Times are seconds since the Unix epoch (float64); NaN means the sample
    has not passed that stage. New stages are appended; a reader treats a
    column it does not have as NaN.
    """

    ISSUED = 0  #: the controller granted the group
    ROLLOUT_START = 1  #: the engine admitted the request
    ROLLOUT_END = 2  #: the last token was generated
    REWARD_END = 3  #: the reward was computed
    TEACHER_END = 4  #: teacher / reference log-probabilities were computed
    TRAINER_RECEIVED = 5  #: the trainer took the sample off its stream
    CRITIC_END = 6  #: the critic attached its values, advantages and returns


class Message(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """Base of every wire message (never sent itself)."""


def _same_length(msg: msgspec.Struct, a: str, b: str) -> None:
    """Parallel lists must be as long as each other (raised while decoding: `malformed`)."""
    if len(getattr(msg, a)) != len(getattr(msg, b)):
        raise ValueError(f"{a} has {len(getattr(msg, a))} entries and {b} {len(getattr(msg, b))}; they must match")


class Record(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """Base of structs embedded in messages (no tag of their own)."""


# ---------------------------------------------------------------------------
# Data plane
# ---------------------------------------------------------------------------


class PromptGroup(Message, tag=1, frozen=True):
    """One prompt to be answered `n` times (a GRPO group)."""

    group_id: NonNegInt
    """Unique id for the whole run; the unit of credit, acknowledgement and reissue."""
    prompt_ids: list[int]
    """Token ids of the prompt."""
    n: Annotated[int, Meta(ge=1)]
    """Samples to generate for this prompt."""
    reference: str = ""
    """What a verifier checks the answers against (e.g. the correct answer)."""
    task: str = ""
    """Name of the task the prompt comes from; selects the reward function."""
    meta: dict[str, str] = {}
    """Free-form per-prompt data for later roles."""
    min_version: NonNegInt = 0
    """Generation must not start on weights older than this policy version."""


class GroupInfo(Record, frozen=True):
    """Per-group part of a `SampleBatch`: the group's samples are contiguous."""

    group_id: NonNegInt
    """The group's id (see `PromptGroup.group_id`)."""
    size: NonNegInt
    """Samples of this group in this batch (<= n after failures are dropped)."""
    n: NonNegInt = 0
    """Samples asked for this group."""
    reference: str = ""
    """Copied from the `PromptGroup`."""
    task: str = ""
    """Copied from the `PromptGroup`."""
    meta: dict[str, str] = {}
    """Copied from the `PromptGroup`."""


class SampleFailure(Record, frozen=True):
    """A per-sample failure, carried in-band instead of a made-up value."""

    index: NonNegInt
    """Row of the failed sample in the batch."""
    stage: Stage
    """Stage at which it failed."""
    kind: str
    """Short class of failure, e.g. ``timeout`` or ``exception``."""
    message: str = ""
    """What happened, for a person."""


class SampleBatch(Message, tag=2, frozen=True):
    """Samples of one or more groups, stored column by column.

    Let ``n`` be the number of samples, ``G = len(groups)`` and ``T`` the total
    number of response tokens. Token data of all samples is concatenated;
    sample ``i``'s response tokens are ``response_ids[response_offsets[i]:
    response_offsets[i+1]]``. The samples of ``groups[g]`` are the next
    ``groups[g].size`` rows, in order; group ``g``'s prompt is
    ``prompt_ids[prompt_offsets[g]:prompt_offsets[g+1]]``.
    """

    groups: list[GroupInfo]
    """The groups whose samples this batch holds, in row order."""
    prompt_ids: Tensor
    """int32 [P]: prompt tokens of every group, concatenated."""
    prompt_offsets: Tensor
    """int64 [G+1]."""
    sample_index: Tensor
    """int32 [n]: index of each sample inside its group (0..n-1)."""
    response_ids: Tensor
    """int32 [T]: response tokens of every sample, concatenated."""
    response_offsets: Tensor
    """int64 [n+1]."""
    logprobs: Tensor
    """float32 [T]: behaviour log-probability of each sampled token."""
    versions: Tensor
    """int32 [T]: policy version that generated each token."""
    finish_reason: Tensor
    """uint8 [n]: `FinishReason` of each sample."""
    stamps: Tensor
    """float64 [n, S]: time each sample passed each `Stage` (NaN: not yet)."""
    rewards: Tensor | None = None
    """float32 [n]: scalar reward, filled in by the reward role."""
    reward_details: dict[str, Tensor] = {}
    """Named float32 [n] components of the reward (e.g. ``correct``, ``format``)."""
    teacher_logprobs: Tensor | None = None
    """float32 [T]: a teacher's log-probability of each response token."""
    ref_logprobs: Tensor | None = None
    """float32 [T]: a frozen reference policy's log-probability of each token."""
    failures: list[SampleFailure] = []
    """Samples that failed at some stage; their other fields are not to be trusted."""
    teacher_topk_ids: Tensor | None = None
    """int32 [T, k]: the teacher's k most likely tokens at each response position."""
    teacher_topk_logprobs: Tensor | None = None
    """float32 [T, k]: the teacher's log-probabilities of those tokens (at the sampling temperature)."""
    advantages: Tensor | None = None
    """float32 [n]: each sample's advantage, worked out over its whole group by trainer rank 0 in the
    share of a step it deals to each trainer rank."""
    loss_mask: Tensor | None = None
    """uint8 [T]: 1 where a response token is the policy's own (trained on), 0 where it is not (an
    episode's observations and the chat template's text between turns); nil: every token is the policy's."""
    env_rewards: Tensor | None = None
    """float32 [n, K]: the environment's reward at each of an episode's first K turns (NaN: no such turn)."""
    values: Tensor | None = None
    """float32 [T]: the critic's value of the state before each response token (filled in by the critic)."""
    returns: Tensor | None = None
    """float32 [T]: the return at each response token by GAE, `token_advantages` + `values` (the critic's
    regression target)."""
    token_advantages: Tensor | None = None
    """float32 [T]: each response token's advantage by GAE over the critic's values (before any
    whitening: the trainer whitens over its step)."""
    critic_versions: Tensor | None = None
    """int32 [n]: the critic version (its optimizer steps so far) that computed each sample's values."""
    response_text: Tensor | None = None
    """uint8 [B]: the text of every sample's response, UTF-8, concatenated: its response tokens decoded by
    the model's tokenizer, special tokens skipped (see SPEC.md, *Text*); filled in by the rollout when a
    replica it streams to asked (`Hello.text`)."""
    response_text_offsets: Tensor | None = None
    """int64 [n+1]: sample ``i``'s text is bytes ``[response_text_offsets[i]:response_text_offsets[i+1]]`` of
    `response_text` (with it, or neither)."""
    prompt_text: Tensor | None = None
    """uint8 [C]: the text of every group's prompt, UTF-8, concatenated, decoded as `response_text` is."""
    prompt_text_offsets: Tensor | None = None
    """int64 [G+1]: group ``g``'s prompt text is bytes ``[prompt_text_offsets[g]:prompt_text_offsets[g+1]]`` of
    `prompt_text` (with it, or neither)."""

    def __post_init__(self) -> None:
        # The columns must agree (offsets in range, lengths, dtypes), so that
        # a receiver can index the batch without further checks; a batch whose
        # columns do not is `malformed`.
        validate(self)

    @property
    def n_samples(self) -> int:
        return self.finish_reason.numel

    @property
    def n_tokens(self) -> int:
        return self.response_ids.numel

    @property
    def group_ids(self) -> list[int]:
        return [g.group_id for g in self.groups]


class ParamSpec(Record, frozen=True):
    """Where one parameter lies in a flat weight buffer."""

    name: str
    """Parameter name, as in the model's state dict."""
    dtype: str
    """Wire dtype name."""
    shape: list[NonNegInt]
    """Dimensions."""
    offset: NonNegInt
    """Byte offset in the flat buffer."""


class WeightsZmq(Record, tag=1, frozen=True):
    """Weights are fetched from the trainer's weight server: a `WeightsRequest`
    to its ROUTER at `address`, answered by one `WeightsPayload`."""

    address: str
    """The weight server's ZeroMQ address (the trainer binds it)."""


class _Collective(Record, frozen=True):
    """Fields of the collective transfers (a base, never sent itself)."""

    host: str
    """Address of the rendezvous (the trainer's host)."""
    port: NonNegInt
    """TCP port of the rendezvous store."""
    world_size: NonNegInt = 0
    """Members of the group: the trainer and every receiver (0 in the trainer's offer: not known yet)."""
    rank: NonNegInt = 0
    """The addressee's rank in the group (0: the trainer)."""
    nbytes: NonNegInt = 0
    """Size of the flat buffer of one update."""
    generation: NonNegInt = 0
    """Counts the groups made for this run; a new one replaces the last (e.g. when a receiver is replaced)."""
    bucket_bytes: NonNegInt = 0
    """Largest piece an update is broadcast in (see SPEC.md, *Weights*): the flat buffer is cut at
    parameter boundaries into pieces of at most this many bytes (0: one piece, the whole buffer)."""


class WeightsGloo(_Collective, tag=2, frozen=True):
    """Weights are broadcast over a torch.distributed gloo group (CPU): trainer
    rank 0 is rank 0 of the group and hosts its TCPStore rendezvous at
    `host`:`port`; each receiver joins with its `rank`. Every update is a flat
    uint8 buffer laid out as the layout says, broadcast in pieces of at most
    `bucket_bytes` cut at parameter boundaries."""


class WeightsNccl(_Collective, tag=3, frozen=True):
    """Weights are broadcast over NCCL between GPUs, as vLLM's "nccl" weight-transfer
    backend receives them (see SPEC.md, *Weights*): trainer rank 0 is NCCL rank 0 and
    hosts the rendezvous at `host`:`port`; `rank` and `world_size` count members (the
    trainer and each receiver), and each receiver takes `ranks_per_receiver` NCCL ranks."""

    ranks_per_receiver: Annotated[int, Meta(ge=1)] = 1
    """NCCL ranks of each receiver: its tensor-parallel workers (the same for every receiver)."""


#: How weights move from the trainer to the replicas that load them.
WeightTransfer = Union[WeightsZmq, WeightsGloo, WeightsNccl]


class AdapterUpdate(enum.IntEnum):
    """How a replica that loads a LoRA adapter takes a new version (see SPEC.md, *Adapters*)."""

    IN_PLACE = 0  #: the new adapter replaces the one served, between two engine steps
    PER_REQUEST = 1  #: each request keeps the adapter version it started with until it ends


class Adapter(Record, frozen=True):
    """A LoRA adapter (PEFT's format) on a frozen base model: weight updates
    carry only its tensors, and every replica serves the base with it."""

    rank: Annotated[int, Meta(ge=1)]
    """The adapter's rank ``r`` (PEFT's ``r``)."""
    alpha: NonNegFloat
    """PEFT's ``lora_alpha``: the update is scaled by ``alpha / rank``."""
    targets: list[str]
    """Names of the modules it adapts (PEFT's ``target_modules``, e.g. ``q_proj``)."""
    update: AdapterUpdate = AdapterUpdate.IN_PLACE
    """How a receiver takes each new version."""
    versions: Annotated[int, Meta(ge=1)] = 1
    """Adapter versions a receiver keeps loaded at most (1 in place; ``max_staleness + 1`` per request)."""


# ---------------------------------------------------------------------------
# Control plane
# ---------------------------------------------------------------------------


class Counters(Record, frozen=True):
    """What a replica has done since it started, each count monotonic. A role
    keeps the counts that apply to it and leaves the others at 0."""

    samples: NonNegInt = 0
    """Samples sent on (the trainer: trained on)."""
    groups: NonNegInt = 0
    """Prompt groups sent on."""
    tokens: NonNegInt = 0
    """Response tokens sent on, scored or trained on."""
    failed_samples: NonNegInt = 0
    """Samples that failed here (or, at the trainer, arrived failed)."""
    decode_steps: NonNegInt = 0
    """A rollout replica: engine steps taken."""
    slot_s: NonNegFloat = 0.0
    """A rollout replica: sequence-seconds its engine spent decoding (its slot time in use)."""
    failed_requests: NonNegInt = 0
    """A rollout replica: requests its engine could not serve (their samples failed)."""
    restarted_groups: NonNegInt = 0
    """A rollout replica: groups generated again because they fell behind the strict staleness bound."""
    restarted_tokens: NonNegInt = 0
    """A rollout replica: tokens thrown away with those groups."""
    bytes_out: NonNegInt = 0
    """Bytes sent on the data plane."""
    weight_updates: NonNegInt = 0
    """A replica that loads weights: updates loaded."""
    failed_updates: NonNegInt = 0
    """A replica that loads weights: updates that failed (the weight group broke)."""
    weight_bytes: NonNegInt = 0
    """The trainer: bytes of weights served."""
    weights_unclaimed: NonNegInt = 0
    """The trainer: versions published that no replica asked for before a newer one."""
    failed_sends: NonNegInt = 0
    """The trainer: weight sends that failed."""
    duplicates: NonNegInt = 0
    """The trainer: copies of groups it already held or trained on (dropped)."""
    stale_groups: NonNegInt = 0
    """The trainer: groups dropped for reissue by the strict staleness check."""
    unexpected_messages: NonNegInt = 0
    """Well-formed messages of a kind not expected on the socket they came in on."""
    scored_samples: NonNegInt = 0
    """A reward replica: samples scored."""
    dropped_groups: NonNegInt = 0
    """A reward replica: groups dropped for good (a sample its functions could not score)."""
    reward_retries: NonNegInt = 0
    """A reward replica: calls retried."""
    rejected: dict[str, NonNegInt] = {}
    """Messages its sockets rejected, by kind (`malformed`, `wrong_version`, ...; see *Validation*)."""
    reward_calls: dict[str, NonNegInt] = {}
    """A reward replica: calls of each reward function by outcome, as ``<function>.<status>`` (status: ok,
    timeout, error, crashed)."""
    bytes_shared: NonNegInt = 0
    """Bytes of tensors sent through shared memory instead of the socket (peers on one machine)."""
    env_requests: NonNegInt = 0
    """An env replica: requests answered (resets and steps); a rollout replica: answers it received."""
    env_calls: dict[str, NonNegInt] = {}
    """An env replica: calls of the environment and of each tool by outcome, as ``reset.<status>``,
    ``step.<status>``, ``tool.<name>.<status>`` (status: ok, timeout, error, crashed), and tool calls that
    could not be parsed (``tool.unparsed``) or name no tool (``tool.unknown``)."""
    episodes: NonNegInt = 0
    """A rollout replica: episodes finished (every sample of a run with environments or outside agents is one)."""
    episode_turns: NonNegInt = 0
    """A rollout replica: model turns of those episodes."""
    critic_steps: NonNegInt = 0
    """The critic (rank 0, for all its ranks): optimizer steps taken (its version, less the steps it
    resumed from)."""
    critic_tokens: NonNegInt = 0
    """The critic (rank 0): response tokens trained on."""
    value_s: NonNegFloat = 0.0
    """The critic (rank 0): seconds spent computing values (forward passes)."""
    critic_step_s: NonNegFloat = 0.0
    """The critic (rank 0): seconds spent training (forward, backward and optimizer step)."""
    no_signal_groups: NonNegInt = 0
    """The trainer: groups dropped for good because every reward in them was equal (`run.filter =
    "signal"`; the controller grants other prompts in their place)."""
    agent_events: dict[str, NonNegInt] = {}
    """A rollout replica serving outside agents: what its endpoint saw, as ``taken`` (episodes handed out),
    ``abandoned`` (episodes no request came for in time), ``template_mismatch`` (turns whose conversation the
    chat template would render otherwise than the recorded tokens), ``refused`` (requests answered with an
    error), ``refused_key`` (requests without the run's key), ``failed_turns`` and ``exits`` (agent copies
    it started that exited)."""

    @property
    def progress(self) -> int:
        """Work done, for telling a replica that works from one that hangs:
        failed samples do not count."""
        return (self.decode_steps + self.groups + self.tokens + self.samples + self.env_requests
                + self.critic_steps - self.failed_samples)


class EngineLoad(Record, frozen=True):
    """A rollout replica's engine now (its scheduler's view)."""

    slots: NonNegInt = 0
    """Sequences it decodes at once."""
    running: NonNegInt = 0
    """Requests being decoded."""
    waiting: NonNegInt = 0
    """Requests waiting to start (for a slot or KV-cache room)."""
    kv_cache_usage: Annotated[float, Meta(ge=0, le=1)] = 0.0
    """Share of the KV cache in use (0 where the engine has none)."""
    preemptions: NonNegInt = 0
    """Requests preempted so far for want of KV-cache room (each recomputes later)."""


class Hello(Message, tag=10, frozen=True):
    """A service's first message to the controller, sent once its endpoints are bound."""

    role: Role
    """The role this service plays."""
    rank: NonNegInt
    """Replica index within the role."""
    replicas: Annotated[int, Meta(ge=1)]
    """Replicas of the role."""
    schema_version: int
    """The sender's `SCHEMA_VERSION`; the controller refuses a mismatch."""
    endpoints: dict[str, str] = {}
    """Name -> ZeroMQ address of each socket this service binds (e.g. ``in``)."""
    pid: int = 0
    """Process id, for diagnostics."""
    host: str = ""
    """Host name or address, for diagnostics."""
    incarnation: NonNegInt = 0
    """Which start of this replica this is: above every earlier start's (rlflow's launcher counts 0, 1, 2,
    ...; an external replica that keeps no state of its own may use the time in milliseconds)."""
    secret: str = ""
    """The run's secret, given to every replica at start; a hello without it is refused (`unauthenticated`)."""
    weights: WeightTransfer | None = None
    """The trainer (rank 0): how it sends weights."""
    layout: list[ParamSpec] = []
    """The trainer (rank 0): where each parameter lies in the flat buffer of a collective transfer (with
    `adapter`, over any transfer: the adapter's tensors, see SPEC.md, *Adapters*)."""
    slots: NonNegInt = 0
    """A rollout replica: sequences it decodes at once (0: the run's samples per prompt)."""
    model: str = ""
    """The model it serves or scores with, for diagnostics."""
    probe: list[float] = []
    """A teacher replica: its log-probabilities of the probe sequence (replicas that disagree do not run together)."""
    problems: list[str] = []
    """A reward replica: what its start-up check of the reference answers found wrong (warnings)."""
    threads: NonNegInt = 0
    """Threads it computes with (0: not said)."""
    cpus: str = ""
    """The CPUs it may run on, e.g. ``0-3,6`` (empty: not said)."""
    shm: str = ""
    """Which processes' shared memory it can map, as ``<boot id>/<PID namespace>/<user id>`` (see SPEC.md,
    *Tensors in shared memory*); empty: it neither sends nor takes tensors in shared memory."""
    adapter: Adapter | None = None
    """The trainer (rank 0): the LoRA adapter its weight updates carry instead of the whole model (nil:
    the whole model); `layout` then lists the adapter's tensors, named as in PEFT's adapter file."""
    text: bool = False
    """A replica that takes sample batches: it wants the text of each response and prompt in them (see
    SPEC.md, *Text*); false: token ids alone."""


class Welcome(Message, tag=11, frozen=True):
    """The controller's answer to `Hello`: who to stream to, and the clock."""

    schema_version: int
    """The controller's `SCHEMA_VERSION`."""
    run_id: str
    """Name of the run."""
    peers: dict[str, list[str]] = {}
    """Output name -> addresses of every downstream replica to connect to."""
    version: NonNegInt = 0
    """The current policy version."""
    heartbeat_s: float = 1.0
    """Seconds between heartbeats: the run's `cluster.heartbeat_s`, or longer in a run of many replicas (the
    controller asks for at most 100 heartbeats a second of all replicas together, and never for fewer than
    four within `cluster.heartbeat_timeout_s`)."""
    weights: WeightTransfer | None = None
    """To a replica that loads weights: how to receive them (its rank in a collective group); to the
    trainer: the group it hosts (its world size)."""
    layout: list[ParamSpec] = []
    """To a replica that loads weights over a collective transfer, or an adapter over any: the trainer's
    layout."""
    shm_peers: list[str] = []
    """The addresses in `peers` whose replicas take tensors in shared memory from this one (their `Hello.shm`
    is its own)."""
    adapter: Adapter | None = None
    """To a replica that loads weights: the LoRA adapter it serves on the base model, as the trainer's
    `Hello` offered it (nil: weight updates are the whole model)."""
    text_peers: list[str] = []
    """The addresses in `peers` whose replicas asked for text (`Hello.text`): a rollout replica that streams
    to any of them fills in the text columns of every batch it sends (see SPEC.md, *Text*)."""


class Ready(Message, tag=12, frozen=True):
    """The service has connected to its peers and can take work."""

    version: NonNegInt = 0
    """Policy version of the weights it holds."""


class Heartbeat(Message, tag=13, frozen=True):
    """Periodic liveness and metrics. Times are cumulative seconds since start."""

    seq: NonNegInt
    """Counts heartbeats from 0."""
    version: NonNegInt
    """Policy version of the weights the service holds (a critic: the version of its own weights, its
    optimizer steps so far)."""
    busy_s: NonNegFloat = 0.0
    """Doing its work."""
    starved_s: NonNegFloat = 0.0
    """Waiting for input."""
    blocked_s: NonNegFloat = 0.0
    """Waiting for the downstream role to take output."""
    loading_s: NonNegFloat = 0.0
    """Receiving or applying weights."""
    queues: dict[str, int] = {}
    """Name -> items waiting there now."""
    counters: Counters = Counters()
    """What it has done since it started (monotonic)."""
    engine: EngineLoad | None = None
    """A rollout replica: its engine's load now (nil: another role)."""


class Credits(Message, tag=14, frozen=True):
    """Permission to start prompt groups. ``group_ids[i]`` may not start on
    weights older than ``min_versions[i]``."""

    group_ids: list[NonNegInt]
    """Groups that may start."""
    min_versions: list[NonNegInt]
    """Oldest policy version each group may start on (as many as `group_ids`)."""

    def __post_init__(self) -> None:
        _same_length(self, "group_ids", "min_versions")


class StepDone(Message, tag=15, frozen=True):
    """The trainer finished an optimizer step; this acknowledges the groups it used."""

    step: NonNegInt
    """Optimizer steps done before this one."""
    version: NonNegInt
    """Policy version produced by this step."""
    acked: list[NonNegInt]
    """Group ids trained on in this step: never to be issued again."""
    metrics: dict[str, float] = {}
    """The step's loss, reward, staleness and other statistics."""


class Expired(Message, tag=16, frozen=True):
    """Groups a role dropped without using (e.g. too stale); to be reissued."""

    group_ids: list[NonNegInt]
    """Groups to issue again."""
    reason: str = ""
    """Why they were dropped."""
    errors: list[str] = []
    """Empty, or as many as `group_ids`: what went wrong with each (e.g. its prompt's row and the first
    sample's failure), kept by the controller to name a group it gives up on."""

    def __post_init__(self) -> None:
        if self.errors:
            _same_length(self, "group_ids", "errors")


class WeightsReady(Message, tag=17, frozen=True):
    """The trainer (rank 0) has a new policy version to publish (trainer -> controller)."""

    version: NonNegInt
    """The new policy version."""
    nbytes: NonNegInt = 0
    """Size of the weights in bytes."""
    checksum: str = ""
    """The weights' checksum (SPEC.md, *Checksums*) when they are an adapter or travel over ZeroMQ; empty:
    not checked."""


class UpdateWeights(Message, tag=18, frozen=True):
    """Load policy `version` (controller -> each replica that loads weights)."""

    version: NonNegInt
    """The policy version to load."""
    transfer: WeightTransfer | None = None
    """A new collective group to join before receiving (nil: the one from `Welcome`, or the last one given)."""


class WeightsLoaded(Message, tag=19, frozen=True):
    """A replica now generates with `version`."""

    version: NonNegInt
    """The policy version now in use."""
    seconds: NonNegFloat = 0.0
    """Time from the update command to generation resumed."""
    checksum: str = ""
    """The checksum (SPEC.md, *Checksums*) of the weights of `version` as the replica received them and
    handed them to its engine; the controller fails the run when it is not the trainer's."""


class Shutdown(Message, tag=22, frozen=True):
    """Stop, release resources and exit."""

    reason: str = ""
    """Why, for the log."""
    secret: str = ""
    """To the controller from outside the run (`rlflow down`): the run's secret, without which it is ignored."""


class ErrorReport(Message, tag=23, frozen=True):
    """Something went wrong. From a replica: `fatal` means it is exiting. From the
    controller: `fatal` means the replica must exit (it was refused or replaced)."""

    fatal: bool
    """A replica: it is exiting because of it. The controller: the replica must exit."""
    kind: str
    """Short class of error: one of the kinds of SPEC.md (*Error kinds*), or, in a replica's fatal report,
    the type of the error that ended it."""
    message: str
    """What happened, for a person."""


#: `ErrorReport.kind` (not fatal) of a trainer or rollout replica whose weight
#: broadcast failed (a member of the collective group died mid-way).
WEIGHT_GROUP_BROKEN = "weight_group_broken"
#: `ErrorReport.kind` (fatal, from the controller) to a hello of another schema version.
WRONG_VERSION = "wrong_version"
#: `ErrorReport.kind` (fatal, from the controller) to a hello without the run's secret.
UNAUTHENTICATED = "unauthenticated"
#: `ErrorReport.kind` (fatal, from the controller) to a hello the run has no place for.
UNEXPECTED_HELLO = "unexpected_hello"
#: `ErrorReport.kind` (fatal, from the controller) to any message from an
#: incarnation that was presumed lost and replaced: it must exit.
REPLACED = "replaced"
#: The kinds the controller sends, and their meaning (SPEC.md lists them).
CONTROLLER_ERROR_KINDS = {
    WRONG_VERSION: "a message of another schema version from a peer that is not registered (the report is in the "
    "controller's version and names both)",
    UNAUTHENTICATED: "a `Hello` whose `secret` is not the run's",
    UNEXPECTED_HELLO: "a `Hello` for a role and rank the run has no place for, or from an incarnation other than "
    "the one expected now",
    REPLACED: "any message from an incarnation the controller presumed lost and replaced: its groups were "
    "granted again; it must exit",
}


class Bye(Message, tag=24, frozen=True):
    """The service exits cleanly."""

    reason: str = ""
    """Why, for the log."""


# ---------------------------------------------------------------------------
# Weights over ZeroMQ
# ---------------------------------------------------------------------------


class WeightsRequest(Message, tag=40, frozen=True):
    """Ask a weight server for a policy version."""

    version: NonNegInt
    """The version wanted."""
    shm: str = ""
    """The requester's `Hello.shm`: a server whose own is the same may send the payload's tensors in shared
    memory (empty: in frames)."""


class WeightsPayload(Message, tag=41, frozen=True):
    """Parameters of one policy version, one tensor (and frame) each."""

    version: NonNegInt
    """Policy version of these weights."""
    names: list[str]
    """Parameter names, as in the model's state dict."""
    tensors: list[Tensor]
    """The parameters, in the order of `names` (as many)."""

    def __post_init__(self) -> None:
        _same_length(self, "names", "tensors")


class Ack(Message, tag=25, frozen=True):
    """These groups have passed `stage` at the sending replica (e.g. a rollout
    replica has finished generating them and sent them on)."""

    stage: Stage
    """The stage they passed."""
    group_ids: list[NonNegInt]
    """The groups."""


class Evaluate(Message, tag=26, frozen=True):
    """Evaluate the task's held-out set with the weights held now (controller -> rollout)."""

    version: NonNegInt
    """The policy version the controller expects to be evaluated."""
    temperature: NonNegFloat = 0.0
    """0: greedy."""


#: `Dropped.reason` of groups the trainer drops under `run.filter = "signal"`: every reward of each is equal.
NO_SIGNAL = "no_signal"


class Dropped(Message, tag=29, frozen=True):
    """Groups a role dropped for good (e.g. their reward could not be
    computed): they are counted with the reason and never granted again."""

    group_ids: list[NonNegInt]
    """The groups."""
    reason: str = ""
    """Why, for the ledger and the log (`no_signal`: the signal filter's, not a fault)."""


class Peers(Message, tag=30, frozen=True):
    """The addresses to stream to now (controller -> replica), when a replica
    of the next role has been replaced: connect to the new ones, let go of
    the others."""

    peers: dict[str, list[str]]
    """As `Welcome.peers`."""
    shm_peers: list[str] = []
    """As `Welcome.shm_peers`."""
    text_peers: list[str] = []
    """As `Welcome.text_peers`."""


class WeightsGroup(Message, tag=31, frozen=True):
    """The collective group the trainer now hosts (trainer rank 0 ->
    controller), after `SendWeights` asked for a new generation, once the
    sends asked before it are done: its rendezvous port, for the controller
    to hand to every receiver. A generation replaced by a newer one before
    its turn is not hosted (that order's version is not broadcast)."""

    transfer: WeightTransfer
    """The group (its `generation` the one asked for)."""


class SendWeights(Message, tag=28, frozen=True):
    """Send policy `version` to the replicas that load weights (controller -> every trainer rank)."""

    version: NonNegInt
    """The policy version to send (one the trainer has published)."""
    transfer: WeightTransfer | None = None
    """A new collective group to host before sending (nil: the current one): its generation and world
    size; the trainer picks the port and says so in `WeightsGroup` before it sends."""


class EvalDone(Message, tag=27, frozen=True):
    """Results of an `Evaluate` (rollout -> controller)."""

    version: NonNegInt
    """Policy version held when the evaluation started."""
    metrics: dict[str, float] = {}
    """``accuracy`` and its breakdown (e.g. ``accuracy.digits_3``)."""
    seconds: NonNegFloat = 0.0
    """How long it took."""
    version_end: NonNegInt = 0
    """Policy version held when it ended (weights may change while it runs)."""


# ---------------------------------------------------------------------------
# Environments: request and reply between a rollout replica and the env role
# ---------------------------------------------------------------------------


class ChatMessage(Record, frozen=True):
    """One chat message of an observation, as the chat template renders it."""

    role: str
    """``user``, ``tool``, ``system``, ... (the template's roles)."""
    content: str
    """The message's text."""
    name: str = ""
    """A tool's message: the tool's name."""
    tool_call_id: str = ""
    """A tool's message: the id of the call it answers (empty: the call had none)."""


class ToolCall(Record, frozen=True):
    """A tool call the rollout parsed out of a model turn."""

    name: str
    """The tool's name, as the model wrote it."""
    arguments: str
    """Its arguments: a JSON object, as text."""
    id: str = ""
    """The call's id, where the model's format has one."""


class ToolResult(Record, frozen=True):
    """How one tool call of a step ended (the observation says what it returned)."""

    name: str
    """The tool's name, as the model wrote it."""
    status: str
    """``ok``, ``timeout``, ``error`` (it raised), ``crashed`` (its worker died), ``unknown`` (no such tool)
    or ``unparsed`` (the turn's tool calls could not be parsed)."""


class EnvReset(Message, tag=50, frozen=True):
    """Start the episodes of a group (rollout -> env replica): the environment's first
    observation of the group's dataset row, which every episode of the group starts from."""

    request_id: NonNegInt
    """Chosen by the requester; the reply carries it back."""
    group_id: NonNegInt
    """The group the episodes belong to."""
    row: dict[str, Any] = {}
    """The group's dataset row (plain data)."""
    reference: str = ""
    """The group's reference answer (`PromptGroup.reference`)."""
    scripted: bool = False
    """Also send the environment's scripted model turns for this row, where it has them (`rlflow check`)."""


class EnvStep(Message, tag=51, frozen=True):
    """One model turn of one episode, for the environment to answer (rollout -> env replica).
    With tool calls, the tools run and their results are the observation; without, the
    environment's `step` answers."""

    request_id: NonNegInt
    """Chosen by the requester; the reply carries it back."""
    group_id: NonNegInt
    """The episode's group."""
    index: NonNegInt
    """The episode's index in its group."""
    turn: Annotated[int, Meta(ge=1)]
    """The model turns of the episode so far, this one included."""
    text: str
    """This model turn, as text."""
    calls: list[ToolCall] = []
    """The tool calls parsed out of it (empty: none, or none could be parsed)."""
    unparsed: str = ""
    """Why the turn's tool calls could not be parsed (empty: they were, or it has none)."""
    state: dict[str, Any] = {}
    """The episode's state, as the environment's last reply left it."""
    row: dict[str, Any] = {}
    """The group's dataset row."""
    reference: str = ""
    """The group's reference answer."""
    turns: list[str] = []
    """The episode's earlier model turns, as text, in order."""


class EnvReply(Message, tag=52, frozen=True):
    """The answer to an `EnvReset` or `EnvStep` (env replica -> rollout): an observation,
    as plain text or as chat messages, and for a step the environment's reward and
    whether the episode is over."""

    request_id: NonNegInt
    """The request's."""
    text: str = ""
    """The observation as text (when it is not `messages`)."""
    messages: list[ChatMessage] = []
    """The observation as chat messages."""
    reward: float = 0.0
    """A step: the environment's reward for this turn."""
    done: bool = False
    """A step: the episode is over (no observation follows)."""
    state: dict[str, Any] = {}
    """The episode's state, to send back with its next step."""
    tools: list[str] = []
    """A reset: each tool's JSON schema, as text (what the chat template shows the model)."""
    results: list[ToolResult] = []
    """A step with tool calls: how each ended."""
    scripted: list[str] = []
    """A reset asked for them: the environment's scripted model turns for the row."""
    error: str = ""
    """The environment itself failed on this request (its episode fails): what happened (empty: it did not)."""
    error_kind: str = ""
    """With `error`: ``timeout``, ``error`` or ``crashed``."""


#: `PromptGroup` is on no channel: a task makes it inside a rollout replica (see SPEC.md).
DataMessage = Union[SampleBatch]
ControlMessage = Union[
    Hello,
    Welcome,
    Ready,
    Heartbeat,
    Credits,
    StepDone,
    Expired,
    WeightsReady,
    UpdateWeights,
    WeightsLoaded,
    Shutdown,
    ErrorReport,
    Bye,
    Ack,
    Evaluate,
    EvalDone,
    SendWeights,
    Dropped,
    Peers,
    WeightsGroup,
]
WeightsMessage = Union[WeightsRequest, WeightsPayload]
EnvMessage = Union[EnvReset, EnvStep, EnvReply]
AnyMessage = Union[PromptGroup, DataMessage, ControlMessage, WeightsMessage, EnvMessage]

#: Every message class, by tag.
MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (
        PromptGroup,
        SampleBatch,
        Hello,
        Welcome,
        Ready,
        Heartbeat,
        Credits,
        StepDone,
        Expired,
        WeightsReady,
        UpdateWeights,
        WeightsLoaded,
        Shutdown,
        ErrorReport,
        Bye,
        Ack,
        Evaluate,
        EvalDone,
        SendWeights,
        Dropped,
        Peers,
        WeightsGroup,
        WeightsRequest,
        WeightsPayload,
        EnvReset,
        EnvStep,
        EnvReply,
    )
}
