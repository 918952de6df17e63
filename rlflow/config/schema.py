"""The schema of a run's configuration: one msgspec Struct per TOML table.

Every table forbids unknown keys; numbers carry bounds; alternatives (which
engine a role runs) are tagged unions on a ``kind`` key; every field has a
docstring (`undocumented_fields` lists those that do not, and a test keeps
it empty). What involves several fields is checked in `checks`.

This module holds the root, `Config`, and the tables of no role; each
role's tables are in a module of the role's name, on the bases in `base`:
here, or the ``config`` module of the role's folder under ``services/``
(the teacher's and the critic's so far).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from rlflow.config.base import NonNegFloat, NonNegInt, PosFloat, PosInt, Table, kind_of
from rlflow.config.cluster import ClusterConfig, PoolConfig
from rlflow.config.env import EnvRole
from rlflow.config.reward import RewardRole
from rlflow.config.rollout import RolloutRole
from rlflow.config.run import RunConfig, SimTask, TaskConfig
from rlflow.config.trainer import ADAPTER_DIR, Lora, TrainerRole
from rlflow.protocol.spec import field_docs
from rlflow.roles import NAMES
from rlflow.services.critic.config import CriticRole
from rlflow.services.teacher.config import TeacherRole


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
    router: bool = True
    """Serve one endpoint in front of every replica's, beside the controller (agents.json's ``url``): it
    sends each take where episodes wait and each episode's requests to the replica that holds it."""
    router_port: NonNegInt = 0
    """Port of the router's endpoint (0: any free port)."""
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
    sampling: Literal["refuse", "run"] = "refuse"
    """A request that asks to sample otherwise than the run does (`temperature`, `top_p`, `top_k`,
    `min_p`, penalties, `logit_bias` other than the run's): refuse: answered 400 naming the field (the
    trainer learns from the run's sampling, so another would be a silent change); run: sampled as the
    run does anyway, and the answer's `system_fingerprint` says "rlflow-run-sampling"."""
    keep_alive_s: PosFloat = 30.0
    """A connection with no request under way, or one still sending a request's head, is closed after
    this long (OpenAI clients open another when they need one)."""
    read_timeout_s: PosFloat = 60.0
    """A request's body must arrive within this long, or it is answered 408."""
    max_body_bytes: PosInt = 16 << 20
    """A request's body over this is answered 413."""
    max_connections: PosInt = 4096
    """Connections a replica's endpoint holds at once; one more is answered 503 with Retry-After and
    closed."""


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
        """Whether the trainer's step `step` leaves the policy as it is (a role's own learning goes
        first: `RoleTable.holds_policy`)."""
        return any(role.holds_policy(step) for _, role in self.role_items())

    @property
    def needs_model(self) -> bool:
        """Whether a real engine loads the policy or its tokenizer (the simulated ones do not)."""
        engines: list[Table] = [role.engine for _, role in self.role_items() if role.uses_policy]
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
    missing: list[str] = []
    seen: set[type] = set()
    todo: list[type] = [Config]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        docs = field_docs(cls)
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)  # todo holds Struct classes only
        for field in info.fields:
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
