"""The episodes a replica hands to outside agents, as a plain state machine (`AgentBook`).

No I/O and no waiting here: the endpoint (`agents.AgentEndpoint`) serves
HTTP, runs the engine and waits; the book says what each event does to the
episodes, and refuses what may not happen (`Refused`, with the HTTP status
and OpenAI error type the endpoint answers it with). Its clock is injected
(`now`, in seconds): the endpoint gives it trio's.

An episode's life: handed out with its group (`hand_out`; held-out ones
first, `hand_out_first`) and queued; taken by an agent (`take`); its turns
(`room` before each, `turn_started` / `turn_ended` around the engine's
work, `record` after); ended by its agent (`finish`), or given up after
`idle_timeout_s` with no request (`idle`). A group is done when each of its
episodes is: `finish` returns it whole, its prompt the part its episodes'
first prompts share (`assemble`); `idle` returns it abandoned (one agent
gone spoils its group, which is dropped).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from rlflow.protocol import FinishReason, PromptGroup, Response
from rlflow.services.rollout.source import Trajectory, failed, stamps

#: Reason of a group dropped because an agent never ended one of its episodes.
ABANDONED = "abandoned"


class Refused(Exception):
    """A request the endpoint answers with an error (HTTP status, message, OpenAI error type)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class HeldGroup:
    group: PromptGroup
    issued_at: float
    episodes: list[AgentEpisode] = field(default_factory=list)
    results: list[Response | None] = field(default_factory=list)
    dead: bool = False


@dataclass
class AgentEpisode:
    id: str
    index: int
    row: dict[str, Any]
    reference: str
    prompt: str
    group: HeldGroup | None  # None: a held-out episode
    temperature: float | None = None
    first: list[int] | None = None  # the first request's prompt tokens
    path: Trajectory = field(default_factory=Trajectory)
    seen: int = 0  # chat: messages the episode holds (the agent's and its turns)
    text: str = ""  # completions: the prompt and turns as text
    turns: int = 0
    last: float = math.inf  # the clock's time of its last request (inf: not taken yet)
    busy: bool = False
    cut: FinishReason = FinishReason.STOP
    result: Response | None = None


class AgentBook:
    """The episodes of one replica's endpoint (see the module). `cfg`: the `[agents]` table;
    `turn_tokens`: the most tokens a turn may have; `takes_reward`: whether the run's reward is the
    agents' (``kind = "env"``: an episode is ended with one; else the reward role scores it, and a
    held-out episode still needs its agent's); `now`: the clock."""

    def __init__(self, cfg: Any, counters: Counter[str], *, turn_tokens: int, takes_reward: bool,
                 now: Callable[[], float]):
        self.cfg, self.counters, self.now = cfg, counters, now
        self.turn_tokens, self.takes_reward = turn_tokens, takes_reward
        self.episodes: dict[str, AgentEpisode] = {}
        self.queue: collections.deque[AgentEpisode] = collections.deque()
        #: Groups handed out and not yet finished or abandoned.
        self.groups = 0

    @property
    def sessions(self) -> int:
        """Episodes agents hold now: taken, not yet ended."""
        return sum(e.last != math.inf for e in self.episodes.values())

    def hand_out(self, group: PromptGroup, issued_at: float, row: dict[str, Any], prompt: str) -> None:
        """Queue the group's `n` episodes (of dataset `row`, its prompt as text)."""
        held = HeldGroup(group, issued_at, results=[None] * group.n)
        for i in range(group.n):
            episode = AgentEpisode(id=f"{group.group_id}-{i}-{secrets.token_hex(4)}", index=i, row=row,
                                   reference=group.reference, prompt=prompt, group=held)
            held.episodes.append(episode)
            self.episodes[episode.id] = episode
            self.queue.append(episode)
        self.groups += 1

    def hand_out_first(self, rows: Sequence[tuple[dict[str, Any], str, str]], temperature: float
                       ) -> list[AgentEpisode]:
        """A held-out episode of each (row, reference, prompt), at `temperature`, queued before the rest."""
        played = [AgentEpisode(id=f"eval-{i}-{secrets.token_hex(4)}", index=0, row=row, reference=reference,
                               prompt=prompt, group=None, temperature=temperature)
                  for i, (row, reference, prompt) in enumerate(rows)]
        for episode in played:
            self.episodes[episode.id] = episode
        self.queue.extendleft(reversed(played))
        return played

    def take(self) -> AgentEpisode | None:
        """The next episode for an agent (None: none is queued)."""
        if not self.queue:
            return None
        episode = self.queue.popleft()
        episode.last = self.now()
        self.counters["agents.taken"] += 1
        return episode

    def episode(self, episode_id: str) -> AgentEpisode:
        """The episode a request names, which may have a request now."""
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise Refused(410 if episode_id else 400,
                          f"no episode {episode_id!r} here: it was ended, abandoned, or never handed out"
                          if episode_id else "no episode named: use the episode's base_url, or its id as 'user'",
                          "episode_gone" if episode_id else "invalid_request_error")
        if episode.busy:
            raise Refused(409, f"episode {episode_id} has a turn under way: one request at a time")
        if episode.result is not None:
            raise Refused(410, f"episode {episode_id} is over", "episode_gone")
        episode.last = self.now()
        return episode

    def room(self, episode: AgentEpisode, added: list[int], asked: int | None, context: int | None
             ) -> tuple[list[int], list[int], list[int], int]:
        """Whether `episode` may have a turn after the tokens `added` (else refused), asking for at most
        `asked` tokens, in a model of `context` positions; its (first prompt, tokens added, whole
        prompt, most tokens it may have)."""
        if episode.turns >= self.cfg.max_turns:
            episode.cut = FinishReason.TURNS
            raise Refused(400, f"episode {episode.id} has had its {self.cfg.max_turns} turns (agents.max_turns): "
                               "end it", "episode_over")
        if episode.first is None:
            first, added = added, []
        else:
            first = episode.first
        room = self.cfg.max_tokens - len(episode.path.ids) - len(added)
        if room <= 0:
            episode.cut = FinishReason.LENGTH
            raise Refused(400, f"episode {episode.id} has no tokens left (agents.max_tokens = "
                               f"{self.cfg.max_tokens}): end it", "episode_over")
        cap = min(self.turn_tokens, room, asked or self.turn_tokens)
        prompt = first + episode.path.ids + added
        if context:
            if len(prompt) >= context:
                raise Refused(400, f"the prompt is {len(prompt)} tokens, the model's context {context}: nothing "
                                   "is left to generate; shorten it", "context_length_exceeded")
            cap = min(cap, context - len(prompt))
        return first, added, prompt, cap

    def turn_started(self, episode: AgentEpisode) -> None:
        episode.busy = True

    def turn_ended(self, episode: AgentEpisode) -> None:
        episode.busy = False
        episode.last = self.now()

    def record(self, episode: AgentEpisode, first: list[int], added: list[int], out: Response, version: int) -> None:
        """Keep the turn `out`, generated after the tokens `added` (`first`: the episode's first prompt);
        `version`: the engine's policy version now."""
        if episode.result is not None or episode.id not in self.episodes:
            raise Refused(410, f"episode {episode.id} was abandoned while its turn ran", "episode_gone")
        if episode.first is None:
            episode.first = first
            episode.path.started = time.time()
        episode.path.observe(added, episode.path.versions[-1] if episode.path.versions else version)
        episode.path.add(out, model=True)
        episode.turns += 1
        if out.finish_reason == FinishReason.LENGTH:
            episode.cut = FinishReason.LENGTH
        self.counters["episode_turns"] += 1

    def finish(self, episode_id: str, reward: Any, version: int) -> tuple[PromptGroup, list[Response]] | None:
        """The agent ended the episode with `reward` (None: the reward role scores it); its group, if
        that was its last episode to end."""
        episode = self.episode(episode_id)
        if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
            raise Refused(400, f"reward {reward!r}: expected a finite number, or none")
        if reward is None and (self.takes_reward or episode.group is None):
            raise Refused(400, "this episode is scored by its agent: end it with {\"reward\": <number>}")
        if episode.turns == 0:
            result = failed(time.time(), "agent_no_turn", f"episode {episode_id} ended before any turn")
        else:
            path = episode.path
            result = Response(
                token_ids=np.asarray(path.ids, np.int32), logprobs=np.asarray(path.logprobs, np.float32),
                versions=np.asarray(path.versions, np.int32), finish_reason=episode.cut,
                stamps=stamps(episode.group.issued_at if episode.group else time.time(), path.started),
                loss_mask=np.asarray(path.mask, np.uint8),
                # One entry a turn (as an environment's), the agent's reward at its last: solved by turn k
                # when it ended then with a reward above 0.
                env_rewards=np.asarray([0.0] * (episode.turns - 1) + [reward or 0.0], np.float32))
        self.counters["episodes"] += 1
        return self._end(episode, result, version)

    def idle(self) -> tuple[list[tuple[int, str]], list[AgentEpisode]]:
        """Give up on the episodes with no request for `idle_timeout_s`: the groups abandoned (id, why),
        and the held-out episodes ended so (each a failed sample)."""
        now, limit = self.now(), self.cfg.idle_timeout_s
        abandoned, ended = [], []
        for episode in [e for e in self.episodes.values() if not e.busy and now - e.last > limit]:
            if episode.id not in self.episodes:
                continue  # gone with its group already
            why = f"episode {episode.id} had no request for {limit:g} s (agents.idle_timeout_s)"
            self.counters["agents.abandoned"] += 1
            held = episode.group
            if held is None:
                self._end(episode, failed(time.time(), ABANDONED, why, episode.path), 0)
                ended.append(episode)
                continue
            held.dead = True
            self.groups -= 1
            for other in held.episodes:
                self.episodes.pop(other.id, None)
            self.queue = collections.deque(e for e in self.queue if e.group is not held)
            abandoned.append((held.group.group_id, why))
        return abandoned, ended

    def _end(self, episode: AgentEpisode, result: Response, version: int) -> tuple[PromptGroup, list[Response]] | None:
        episode.result = result
        self.episodes.pop(episode.id, None)
        held = episode.group
        if held is None or held.dead:
            return None
        held.results[episode.index] = result
        if any(r is None for r in held.results):
            return None
        self.groups -= 1
        return assemble(held, version)


def assemble(held: HeldGroup, version: int) -> tuple[PromptGroup, list[Response]]:
    """The finished group: its prompt the part its episodes' first prompts share, each episode's
    sample the rest of its first prompt (loss mask 0) and its trajectory."""
    played = [(e, r) for e, r in zip(held.episodes, held.results) if r is not None and r.error is None]
    firsts = [e.first for e, _ in played if e.first is not None]
    shared = firsts[0] if firsts else list(held.group.prompt_ids)
    for first in firsts[1:]:
        shared = shared[:common(shared, first)]
    responses = [r for r in held.results if r is not None]  # (each episode has ended)
    for episode, result in played:
        rest = (episode.first or [])[len(shared):]
        if rest:
            start = int(result.versions[0]) if len(result.versions) else version
            responses[episode.index] = dataclasses.replace(
                result, token_ids=np.concatenate([np.asarray(rest, np.int32), result.token_ids]),
                logprobs=np.concatenate([np.zeros(len(rest), np.float32), result.logprobs]),
                versions=np.concatenate([np.full(len(rest), start, np.int32), result.versions]),
                loss_mask=np.concatenate([np.zeros(len(rest), np.uint8), result.loss_mask]))
    return msgspec.structs.replace(held.group, prompt_ids=list(shared)), responses


def common(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
