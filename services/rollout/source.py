"""Where a replica's multi-turn groups are played: the interface both kinds implement, and what they share.

A rollout replica without `[roles.env]` or `[agents]` generates each granted
group itself (the engine's `submit` / `finished`). With one of them, each
group is `n` episodes, and an `EpisodeSource` plays them:
`episodes.EpisodeRunner` against the env role, `agents.AgentEndpoint` for
outside agents over HTTP. The replica's loop talks to either the same way:
it submits what the controller grants, sends on what comes out of
`finished`, tells the controller of each group that comes out of `given_up`
(granted again, or dropped for good), and asks it to evaluate the held-out
set.

Shared here: an episode's token sequence as it grows (`Trajectory`), a
failed episode (`failed`), the held-out metrics of played episodes
(`episode_metrics`), and the one way a group leaves the source without
waiting (`hand_back`), which holds the controller's grants to their rule.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import trio

from rlflow.protocol import FinishReason, PromptGroup, Response, Stage
from rlflow.protocol.batch import N_STAGES


@dataclass(frozen=True)
class GivenUp:
    """A group an episode source gave up on: `again`, granted again (its env replica was lost: the
    controller's `Expired`); else dropped for good (`Dropped` with `reason`: an agent abandoned it)."""

    group_id: int
    why: str
    again: bool
    reason: str


class EpisodeSource(Protocol):
    """Plays the episodes of the groups a replica is granted (see the module)."""

    #: Lists of finished groups, each (group, one response per episode).
    finished: trio.MemoryReceiveChannel
    #: Groups given up on (`GivenUp`), each once.
    given_up: trio.MemoryReceiveChannel

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled (started in the replica's nursery)."""

    def follow(self, addresses: list[str]) -> None:
        """The env replicas now (the controller's `Peers`); a source that needs none ignores them."""

    def submit(self, group: PromptGroup, issued_at: float) -> None:
        """Play the group's `n` episodes."""

    async def evaluate(self, rows: Sequence[tuple[dict[str, Any], str]], concurrency: int, temperature: float
                       ) -> dict[str, float]:
        """One episode of each held-out (row, reference) at `temperature`: `episode_metrics`."""

    def queues(self) -> dict[str, int]:
        """What it holds, for the replica's heartbeat (``episode_groups``: groups submitted and not yet
        finished or given up)."""

    async def close(self, reason: str) -> None:
        """The run is over (`reason`): the agents' requests under way and to come are answered so (an
        env source has none to tell)."""


@dataclass
class Trajectory:
    """One episode's tokens so far, and what it earned."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)
    started: float = math.nan

    def add(self, response: Response, *, model: bool) -> None:
        self.ids += response.token_ids.tolist()
        self.logprobs += response.logprobs.tolist()
        self.versions += response.versions.tolist()
        self.mask += [int(model)] * len(response.token_ids)

    def observe(self, ids: list[int], version: int) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.mask += [0] * len(ids)

    def oldest(self) -> int | None:
        """The policy version of its oldest model token."""
        own = [v for v, m in zip(self.versions, self.mask) if m]
        return min(own) if own else None


class GrantOverrun(RuntimeError):
    """More groups came back out of a replica's episodes at once than the controller lets it hold
    (`groups_held`): the grants broke their rule. The replica ends (and is restarted, its groups
    granted again) rather than hold what no rule bounds."""


def hand_back(send: trio.MemorySendChannel, item: Any) -> None:
    """Put a group that leaves the replica's episodes on its way out, never waiting (a request's
    handler or a failing episode's task sends it). The channel holds as many items as the controller
    lets the replica hold groups (`groups_held`): a group counts as held until the replica acknowledges
    it, which it does once the item is taken, so the channel is full only if the grants broke that rule."""
    try:
        send.send_nowait(item)
    except trio.WouldBlock:
        holds = send.statistics().max_buffer_size
        raise GrantOverrun(f"more than {holds} groups came back out of this replica's episodes at once: the "
                           f"controller lets it hold {holds} (groups_held); the replica ends") from None


def episode_metrics(played: Sequence[Response], max_turns: int) -> dict[str, float]:
    """Held-out metrics of played episodes: the share solved by each turn (``accuracy.turn<k>``: a
    positive environment reward at or before turn k), ``accuracy`` (by the last turn), the mean reward
    and turns; failed ones count as unsolved."""
    n = max(len(played), 1)
    out = {"problems": float(len(played)),
           "failed": float(sum(r.error is not None for r in played)),
           "reward_mean": float(np.mean([np.sum(r.env_rewards) for r in played if r.env_rewards is not None] or [0])),
           "turns_mean": float(np.mean([len(r.env_rewards) for r in played if r.env_rewards is not None] or [0]))}
    for k in range(1, max_turns + 1):
        solved = sum(r.env_rewards is not None and bool((r.env_rewards[:k] > 0).any()) for r in played)
        out[f"accuracy.turn{k}"] = solved / n
    out["accuracy"] = out[f"accuracy.turn{max_turns}"]
    return out


def stamps(issued_at: float, started: float) -> np.ndarray:
    stamps = np.full(N_STAGES, np.nan)
    stamps[Stage.ISSUED] = issued_at
    stamps[Stage.ROLLOUT_START] = started
    stamps[Stage.ROLLOUT_END] = time.time()
    return stamps


def failed(issued_at: float, kind: str, why: str, path: Trajectory | None = None) -> Response:
    """A failed episode (its tokens are not to be used: none are kept)."""
    empty = np.zeros(0, np.int32)
    return Response(token_ids=empty, logprobs=np.zeros(0, np.float32), versions=empty,
                    finish_reason=FinishReason.ERROR,
                    stamps=stamps(issued_at, path.started if path is not None else math.nan),
                    error=why[:500], failure_kind=kind, loss_mask=np.zeros(0, np.uint8))
