"""The env role's table, `[roles.env]` (the specs of its environment and tools are
`rlflow.config.environment`'s, which the env role's processes read too)."""

from __future__ import annotations


from rlflow.config.base import PosFloat, PosInt, NonNegInt, StartedRole
from rlflow.config.environment import EnvironmentSpec, ToolSpec


class EnvRole(StartedRole, kw_only=True, frozen=True):
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
