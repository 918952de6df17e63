"""Episodes played by outside agents over an OpenAI-compatible endpoint (`[agents]`).

Each rollout replica serves, from its own engine, an HTTP endpoint that any
OpenAI client can talk to (docs/agents.md has the whole contract):

* ``POST /rlflow/episodes``: take an episode (long-polled: it waits up to
  ``wait_s`` for one). A granted group is `n` episodes of one task row; the
  answer names the episode (``id``), its ``base_url``, the ``row``, the
  task's ``prompt`` (text) and ``reference``.
* ``{base_url}/chat/completions`` and ``{base_url}/completions`` (streamed
  too): one model turn of that episode each. ``/v1/...`` with the episode id
  in the request's ``user`` field is the same.
* ``POST /rlflow/episodes/{id}/end`` with ``{"reward": r}`` (or no reward,
  where the reward role scores the episode): the episode is over.

Every request carries the run's key (``Authorization: Bearer KEY``). A
request's body is checked by vLLM's own request models (`compat.openai_requests`),
its tool calls read by vLLM's parsers, its chat by the model's template; the
answers have the OpenAI API's shapes (and vLLM's ``token_ids`` fields).

Token-exact trajectories: an episode is one sample, one token sequence,
recorded as the engine made it and never re-tokenized. Its first request's
prompt (rendered by the tokenizer's chat template, or the completion prompt
as it is) starts it; each turn's tokens are kept with their log-probability
and policy version (loss mask 1); what the agent adds before the next turn
(tool results, new messages; for completions, the text after what the
episode holds) is rendered on its own and appended with loss mask 0. The
engine generates each turn on the recorded tokens plus those. Where the
template would render the whole conversation differently (a turn re-rendered
from its parsed tool calls, a changed earlier message), the recorded tokens
win and the ``template_mismatch`` agent event counts it. The group's prompt is the
part its episodes' first prompts share; the rest of each is the start of its
response, not trained on.

An episode with no request for `idle_timeout_s` after it was taken is
abandoned: its group is dropped (reason ``abandoned``), and requests for its
episodes are answered 410. Sampling is the run's (its temperature: the policy
trains on what it samples); a request's ``max_tokens`` may ask for fewer, and
its ``stop`` strings end a turn early (the tokens after are neither returned
nor trained on).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import trio

from rlflow.env.render import EpisodeText, RenderError
from rlflow.protocol import FinishReason, PromptGroup, Response
from rlflow.services.rollout import http
from rlflow.services.rollout.engine import EngineDead
from rlflow.services.rollout.episodes import GrantOverrun, Trajectory, episode_metrics, failed, hand_back, stamps

#: The fingerprint of an answer sampled as the run does where the request asked otherwise (`agents.sampling`).
RUN_SAMPLING = "rlflow-run-sampling"
#: Sampling fields a request may give, with the values that change nothing (top_p and temperature: the run's).
_NEUTRAL: dict[str, tuple[Any, ...]] = {"top_k": (-1, 0), "min_p": (0,), "presence_penalty": (0,),
                                        "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},)}

#: Reason of a group dropped because an agent never ended one of its episodes.
ABANDONED = "abandoned"

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


class _Refused(Exception):
    """A request this endpoint answers with an error (HTTP status, message, OpenAI error type)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class _Group:
    group: PromptGroup
    issued_at: float
    episodes: list[_Episode] = field(default_factory=list)
    results: list[Response | None] = field(default_factory=list)
    dead: bool = False


@dataclass
class _Episode:
    id: str
    index: int
    row: dict[str, Any]
    reference: str
    prompt: str
    group: _Group | None  # None: a held-out episode
    temperature: float | None = None
    first: list[int] | None = None  # the first request's prompt tokens
    path: Trajectory = field(default_factory=Trajectory)
    seen: int = 0  # chat: messages the episode holds (the agent's and its turns)
    text: str = ""  # completions: the prompt and turns as text
    turns: int = 0
    last: float = math.inf  # trio time of its last request
    busy: bool = False
    cut: FinishReason = FinishReason.STOP
    done: trio.Event = field(default_factory=trio.Event)
    result: Response | None = None


@dataclass
class _Live:
    """A turn under way that a streamed answer follows: its tokens so far, then how it ended."""

    ids: list[int] = field(default_factory=list)
    out: Response | None = None
    refused: _Refused | None = None
    done: bool = False
    changed: trio.Event = field(default_factory=trio.Event)

    def update(self, ids: list[int]) -> None:
        self.ids = ids
        self.changed.set()

    async def next(self) -> None:
        """Until the tokens change or the turn ends."""
        await self.changed.wait()
        self.changed = trio.Event()


class AgentEndpoint:
    """The endpoint of one rollout replica, its episodes, and the agents it starts (see the module).
    Finished groups come out of `finished`; groups given up on, out of `abandoned`."""

    def __init__(self, engine: Any, task: Any, cfg: Any, *, text: EpisodeText, make_parser: Any, turn_tokens: int,
                 counters: Counter[str], api_key: str, rank: int, replicas: int, takes_reward: bool,
                 holds: int, import_dir: str = "", log: Any = None):
        self.engine, self.task, self.cfg, self.text = engine, task, cfg, text
        self.make_parser = make_parser
        self.turn_tokens = min(turn_tokens, cfg.turn_tokens or turn_tokens)
        self.counters, self.key = counters, api_key
        self.rank, self.replicas, self.takes_reward = rank, replicas, takes_reward
        self.import_dir, self.log = import_dir, log
        # As many as the controller lets this replica hold (`groups_held`): finished and abandoned groups wait
        # for the replica's loop here (`hand_back`).
        self._send, self.finished = trio.open_memory_channel(holds)
        self._abandoned_send, self.abandoned = trio.open_memory_channel(holds)
        self.episodes: dict[str, _Episode] = {}
        self._queue: collections.deque[_Episode] = collections.deque()
        self._queued = trio.Event()
        self._parsers: dict[str, Any] = {}
        self.groups = 0
        self.url = ""
        #: Why the run ended, once it has (`close`): every request is answered 410 `run_over` then.
        self.over = ""
        #: The scopes of the turns under way, which `close` cancels so that their agents hear why.
        self._turning: set[trio.CancelScope] = set()
        #: The requests under way, until their answers are written.
        self.drain = http.Drain()
        self._nursery: trio.Nursery | None = None

    # -- the replica's side -------------------------------------------------------------------------

    def bind(self) -> str:
        """Take the endpoint's port (before the replica says hello, which names it); its URL."""
        self._sock = http.bind(self.cfg.host, self.cfg.port + self.rank if self.cfg.port else 0)
        host = self.cfg.host if self.cfg.host not in ("0.0.0.0", "::", "") else _own_address()
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        return self.url

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # vLLM's request models are a heavy import (13 s on a 2-core CPU, a minute from a cold disk): made in
        # a thread before the first request, so that the replica's loop (its heartbeats) goes on meanwhile
        await trio.to_thread.run_sync(_requests)
        async with self._send, self._abandoned_send, trio.open_nursery() as nursery:
            self._nursery = nursery  # the streamed turns', which outlive their answers if the client leaves
            # A dead engine ends the endpoint, and with it the replica, which is restarted (its groups granted
            # again), rather than answering 500 to every turn while handing out episodes that cannot be played;
            # so do grants past their rule (`hand_back`).
            limits = http.Limits(keep_alive_s=self.cfg.keep_alive_s, read_timeout_s=self.cfg.read_timeout_s,
                                 max_body=self.cfg.max_body_bytes, max_connections=self.cfg.max_connections)
            await nursery.start(functools.partial(http.serve, fatal=(EngineDead, GrantOverrun), drain=self.drain,
                                                  limits=limits), self.handle, self._sock)
            nursery.start_soon(self._reap)
            for copy in range(self.rank, self.cfg.copies if self.cfg.command else 0, self.replicas):
                nursery.start_soon(self._agent, copy)
            task_status.started()
            await trio.sleep_forever()

    async def close(self, reason: str, grace_s: float = 2.0) -> None:
        """The run is over: requests under way and to come are answered 410 `run_over` (naming `reason`),
        those under way within `grace_s`, rather than cut with the connection."""
        self.over = reason or "stopped"
        for scope in self._turning:
            scope.cancel()
        self._queued.set()  # agents waiting for an episode hear it too
        with trio.move_on_after(grace_s):
            await self.drain.idle()

    @property
    def sessions(self) -> int:
        """Episodes agents hold now: taken, not yet ended."""
        return sum(e.last != math.inf for e in self.episodes.values())

    def follow(self, addresses: list[str]) -> None:
        """Nothing to follow: the agents come to the endpoint."""

    def submit(self, group: PromptGroup, issued_at: float) -> None:
        """Hand out the group's `n` episodes."""
        row = _plain(self.task.row(group.group_id))
        prompt = self.task.decode(np.asarray(group.prompt_ids, np.int64)) if group.prompt_ids else ""
        held = _Group(group, issued_at, results=[None] * group.n)
        for i in range(group.n):
            episode = _Episode(id=f"{group.group_id}-{i}-{secrets.token_hex(4)}", index=i, row=row,
                               reference=group.reference, prompt=prompt, group=held)
            held.episodes.append(episode)
            self.episodes[episode.id] = episode
            self._queue.append(episode)
        self.groups += 1
        self._wake()

    async def evaluate(self, rows: Sequence[tuple[dict[str, Any], str]], concurrency: int, temperature: float
                       ) -> dict[str, float]:
        """One episode of each held-out (row, reference), handed out first, at `temperature`; the
        agents' rewards make the metrics (`episodes.episode_metrics`); one abandoned counts unsolved."""
        played = []
        prompts = self.task.heldout_prompts() if hasattr(self.task, "heldout_prompts") else [[]] * len(rows)
        for i, (row, reference) in enumerate(rows):
            episode = _Episode(id=f"eval-{i}-{secrets.token_hex(4)}", index=0, row=_plain(row), reference=reference,
                               prompt=self.task.decode(np.asarray(prompts[i], np.int64)), group=None,
                               temperature=temperature)
            self.episodes[episode.id] = episode
            played.append(episode)
        self._queue.extendleft(reversed(played))
        self._wake()
        for episode in played:
            await episode.done.wait()
        return episode_metrics([e.result for e in played], self.cfg.max_turns)

    def _wake(self) -> None:
        self._queued.set()
        self._queued = trio.Event()

    async def _reap(self) -> None:
        """Give up on episodes idle for `idle_timeout_s`: their groups are dropped."""
        while True:
            await trio.sleep(min(1.0, self.cfg.idle_timeout_s / 4))
            now = trio.current_time()
            idle = [e for e in self.episodes.values() if not e.busy and now - e.last > self.cfg.idle_timeout_s]
            for episode in idle:
                if episode.id not in self.episodes:
                    continue  # gone with its group already
                why = (f"episode {episode.id} had no request for {self.cfg.idle_timeout_s:g} s "
                       f"(agents.idle_timeout_s)")
                self.counters["agents.abandoned"] += 1
                if episode.group is None:
                    self._end(episode, failed(time.time(), ABANDONED, why, episode.path))
                    continue
                held = episode.group
                held.dead = True
                self.groups -= 1
                for other in held.episodes:
                    self.episodes.pop(other.id, None)
                    other.done.set()
                self._queue = collections.deque(e for e in self._queue if e.group is not held)
                hand_back(self._abandoned_send, (held.group.group_id, why))

    async def _agent(self, copy: int) -> None:
        """One copy of the agent program, started again whenever it exits (after a pause that grows
        while it keeps failing fast)."""
        env = {**os.environ, "RLFLOW_AGENTS_URL": self.url, "OPENAI_API_KEY": self.key,
               "RLFLOW_AGENT_COPY": str(copy)}
        command = list(self.cfg.command)
        if command[0] in ("python", "python3"):
            command[0] = sys.executable  # the run's own interpreter, whatever PATH says on the node
        pause = 1.0
        while True:
            started = trio.current_time()
            # Started from this thread, which runs as long as the replica does: the agent is killed when
            # it ends (a parent-death signal follows the thread that started the process).
            process = subprocess.Popen(command, env=env, cwd=self.import_dir or None, preexec_fn=_die_with_parent)
            try:
                while (code := process.poll()) is None:
                    await trio.sleep(0.5)
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            self.counters["agents.exits"] += 1
            if self.log is not None:
                self.log.warning("[agents] agent %d (%s) exited with %s; starting it again", copy,
                                 " ".join(self.cfg.command), code)
            pause = 1.0 if trio.current_time() - started > 30 else min(pause * 2, 30.0)
            await trio.sleep(pause)

    # -- HTTP ---------------------------------------------------------------------------------------

    async def handle(self, request: http.HttpRequest) -> http.HttpResponse | http.Streamed:
        path = request.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            return http.HttpResponse.of(200, {"ok": True})
        if not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {self.key}"):
            self.counters["agents.refused_key"] += 1
            return http.HttpResponse.error(
                401, "no valid API key: send the run's key (agents.json) as 'Authorization: Bearer KEY'",
                "invalid_api_key")
        try:
            if self.over:
                raise _Refused(410, f"the run is over ({self.over}): stop", "run_over")
            return await self._route(request, path)
        except _Refused as refused:
            self.counters["agents.refused"] += 1
            return http.HttpResponse.error(refused.status, str(refused), refused.kind)

    async def _route(self, request: http.HttpRequest, path: str) -> http.HttpResponse | http.Streamed:
        parts = path.strip("/").split("/")
        episode_id = ""
        if len(parts) >= 3 and parts[0] == "episodes" and parts[2] == "v1":
            episode_id, parts = parts[1], parts[2:]
        route = "/" + "/".join(parts)
        if request.method == "GET" and route == "/rlflow/episodes":
            return await self._held(request)
        if request.method == "GET" and route == "/v1/models":
            return http.HttpResponse.of(200, {"object": "list", "data": [
                {"id": "policy", "object": "model", "created": 0, "owned_by": "rlflow"}]})
        if request.method != "POST":
            raise _Refused(405, f"{request.method} {path}: not served here")
        if route == "/rlflow/episodes":
            return await self._take(request)
        if len(parts) == 4 and parts[:2] == ["rlflow", "episodes"] and parts[3] == "end":
            return self._finish(parts[2], _body(request))
        if route == "/v1/chat/completions":
            return await self._chat(_body(request), episode_id)
        if route == "/v1/completions":
            return await self._complete(_body(request), episode_id)
        raise _Refused(404, f"POST {path}: no such route (see docs/agents.md)")

    async def _take(self, request: http.HttpRequest) -> http.HttpResponse:
        wait = _body(request).get("wait_s", 30.0)
        if not isinstance(wait, (int, float)) or not math.isfinite(wait):
            raise _Refused(400, f"wait_s {wait!r}: expected a number of seconds")
        with trio.move_on_after(max(0.0, min(wait, 300.0))):
            while not self._queue and not self.over:
                await self._queued.wait()
        if self.over:
            raise _Refused(410, f"the run is over ({self.over}): stop", "run_over")
        if not self._queue:
            return http.HttpResponse(204, headers=[(http.QUEUED, "0")])
        episode = self._queue.popleft()
        episode.last = trio.current_time()
        self.counters["agents.taken"] += 1
        answer = http.HttpResponse.of(200, {
            "id": episode.id, "base_url": f"{self.url}/episodes/{episode.id}/v1", "row": episode.row,
            "prompt": episode.prompt, "reference": episode.reference, "eval": episode.group is None,
            "max_turns": self.cfg.max_turns})
        answer.headers.append((http.QUEUED, str(len(self._queue))))
        return answer

    async def _held(self, request: http.HttpRequest) -> http.HttpResponse:
        """How many episodes wait to be taken (taking none): with ``?above=N&wait_s=S``, once more than N
        do, or after S seconds (the router's one request for all the agents it has waiting)."""
        query = urllib.parse.parse_qs(request.path.partition("?")[2])
        wait, above = query.get("wait_s", ["0"])[0], query.get("above", ["0"])[0]
        try:
            seconds, most = float(wait), int(above)
        except ValueError:
            seconds, most = math.nan, 0
        if not math.isfinite(seconds):
            raise _Refused(400, f"wait_s {wait!r}, above {above!r}: expected seconds and a count")
        with trio.move_on_after(max(0.0, min(seconds, 300.0))):
            while len(self._queue) <= most and not self.over:
                await self._queued.wait()
        if self.over:
            raise _Refused(410, f"the run is over ({self.over}): stop", "run_over")
        answer = http.HttpResponse.of(200, {"queued": len(self._queue)})
        answer.headers.append((http.QUEUED, str(len(self._queue))))
        return answer

    def _episode(self, episode_id: str) -> _Episode:
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise _Refused(410 if episode_id else 400,
                           f"no episode {episode_id!r} here: it was ended, abandoned, or never handed out"
                           if episode_id else "no episode named: use the episode's base_url, or its id as 'user'",
                           "episode_gone" if episode_id else "invalid_request_error")
        if episode.busy:
            raise _Refused(409, f"episode {episode_id} has a turn under way: one request at a time")
        if episode.result is not None:
            raise _Refused(410, f"episode {episode_id} is over", "episode_gone")
        episode.last = trio.current_time()
        return episode

    def _finish(self, episode_id: str, body: dict[str, Any]) -> http.HttpResponse:
        episode = self._episode(episode_id)
        reward = body.get("reward")
        if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
            raise _Refused(400, f"reward {reward!r}: expected a finite number, or none")
        if reward is None and (self.takes_reward or episode.group is None):
            raise _Refused(400, "this episode is scored by its agent: end it with {\"reward\": <number>}")
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
        self._end(episode, result)
        return http.HttpResponse.of(200, {"id": episode_id, "ended": True})

    def _end(self, episode: _Episode, result: Response) -> None:
        episode.result = result
        self.episodes.pop(episode.id, None)
        episode.done.set()
        held = episode.group
        if held is None or held.dead:
            return
        held.results[episode.index] = result
        if all(r is not None for r in held.results):
            self.groups -= 1
            hand_back(self._send, [_assemble(held, self.engine.version)])

    # -- turns --------------------------------------------------------------------------------------

    async def _chat(self, body: dict[str, Any], episode_id: str) -> http.HttpResponse | http.Streamed:
        request = _validated(_requests()[0], body)
        episode = self._episode(episode_id or request.user or "")
        fingerprint = self._sampling(body, episode)
        messages = [_message(m) for m in request.messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        choice = "auto" if request.tool_choice is None else getattr(request.tool_choice, "type", request.tool_choice)
        if tools and choice not in ("auto", "none"):
            raise _Refused(400, f"tool_choice {request.tool_choice!r}: the model's tool calls are read from what it "
                                "says, never forced; send \"auto\" or \"none\"")
        try:
            whole = self.text.encode(self.text.render(messages, tools, generation=True))
            if episode.first is None:
                added = whole
            else:
                if len(messages) < episode.seen:
                    raise _Refused(400, f"episode {episode.id} holds {episode.seen} messages; this request has "
                                        f"{len(messages)}: send the whole conversation, each turn's reply included")
                # (no new message: the template's next generation prompt alone)
                added = self.text.following(messages[episode.seen:], tools)
                if whole != episode.first + episode.path.ids + added:
                    self.counters["agents.template_mismatch"] += 1
        except RenderError as exc:
            raise _Refused(400, str(exc)) from None
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        tokens = request.return_token_ids
        reply_id, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), request.model or "policy"
        chunk = {"id": reply_id, "object": "chat.completion.chunk", "created": created, "model": model, **fingerprint}
        usage_too = bool(request.stream_options and request.stream_options.include_usage)
        if request.stream and not tools and not _stops(request.stop) and self._nursery is not None:
            # Streamed as the engine makes it (where a stop string or a tool call starts is known only at the end).
            seen = len(messages) + 1
            prompt_ids, live = self._live(episode, added, asked, lambda out: setattr(episode, "seen", seen))

            def delta(text: str, first: bool = False) -> dict[str, Any]:
                return {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text} if first
                                              else {"content": text}, "logprobs": None, "finish_reason": None}],
                        **({"prompt_token_ids": prompt_ids} if tokens and first else {})}

            async def tail(out: Response, sent: str) -> list[dict[str, Any]]:
                ids = out.token_ids.tolist()
                content = self.text.decode(ids)
                rest = content[len(sent):] if content.startswith(sent) else ""
                return [delta(rest)] * bool(rest) + self._chat_end(
                    chunk, out, _FINISH.get(out.finish_reason, "stop"), request.logprobs, tokens,
                    _usage(prompt_ids, ids) if usage_too else None)

            return http.Streamed(self._follow(live, [delta("", first=True)], delta, tail))
        prompt_ids, out = await self._turn(episode, added, asked, _stops(request.stop))
        episode.seen = len(messages) + 1
        ids = out.token_ids.tolist()
        content, calls = self.text.decode(ids), []
        if tools and choice == "auto" and self.cfg.tool_parser and self.make_parser is not None:
            parse = await self._parser(tools)
            found, _, rest = parse(self.text.tokenizer.decode(ids, skip_special_tokens=False))
            if found:
                calls = [{"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": name, "arguments": arguments}} for name, arguments, call_id in found]
                content = rest or None
        finish = "tool_calls" if calls else _FINISH.get(out.finish_reason, "stop")
        usage = _usage(prompt_ids, ids)
        if not request.stream:
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            return http.HttpResponse.of(200, {
                "id": reply_id, "object": "chat.completion", "created": created, "model": model, **fingerprint,
                "choices": [{"index": 0, "message": message, "logprobs": self._chat_logprobs(out, request.logprobs),
                             "finish_reason": finish, **({"token_ids": ids} if tokens else {})}],
                "usage": usage, **({"prompt_token_ids": prompt_ids} if tokens else {})})
        deltas = [{"role": "assistant", "content": ""}]
        if content:
            deltas.append({"content": content})
        if calls:
            deltas.append({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
        events = [{**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
                   **({"prompt_token_ids": prompt_ids} if tokens and i == 0 else {})} for i, delta in enumerate(deltas)]
        events += self._chat_end(chunk, out, finish, request.logprobs, tokens, usage if usage_too else None)
        return http.Streamed(_sse(events))

    def _chat_logprobs(self, out: Response, wanted: bool | None) -> dict[str, Any] | None:
        return {"content": [{"token": self.text.decode([t]), "logprob": float(lp), "top_logprobs": []}
                            for t, lp in zip(out.token_ids.tolist(), out.logprobs.tolist())]} if wanted else None

    def _chat_end(self, chunk: dict[str, Any], out: Response, finish: str, logprobs: bool | None, tokens: bool | None,
                  usage: dict[str, int] | None) -> list[dict[str, Any]]:
        """A streamed chat answer's last events: how the turn finished (its log-probabilities and token
        ids, where asked), and its usage (None: not asked)."""
        events = [{**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": self._chat_logprobs(out, logprobs),
                                         "finish_reason": finish,
                                         **({"token_ids": out.token_ids.tolist()} if tokens else {})}]}]
        if usage is not None:
            events.append({**chunk, "choices": [], "usage": usage})
        return events

    async def _follow(self, live: _Live, head: list[dict[str, Any]], delta: Any, tail: Any) -> AsyncIterator[bytes]:
        """The events of a turn under way as it goes: `head`, a `delta(text)` whenever its text grows, then
        `tail(out, text sent)`; an error event if the turn is refused (the run ended, its engine failed)."""
        for event in head:
            yield _data(event)
        sent = ""
        while not live.done:
            await live.next()
            text = self.text.decode(live.ids)
            # A character still incomplete in its bytes waits for the token that completes it.
            more = text[len(sent):].rstrip("\ufffd") if text.startswith(sent) else ""
            if more:
                sent += more
                yield _data(delta(more))
        if live.out is None:
            refused = live.refused or _Refused(500, "the turn ended with no answer", "engine_error")
            yield _data({"error": {"message": str(refused), "type": refused.kind, "code": refused.kind,
                                   "status": refused.status}})
        else:
            for event in await tail(live.out, sent):
                yield _data(event)
        yield b"data: [DONE]\n\n"

    async def _complete(self, body: dict[str, Any], episode_id: str) -> http.HttpResponse | http.Streamed:
        request = _validated(_requests()[1], body)
        episode = self._episode(episode_id or request.user or "")
        fingerprint = self._sampling(body, episode)
        if (request.n or 1) != 1:
            raise _Refused(400, "n must be 1: an episode is one sequence")
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            held = episode.text if episode.first is not None else ""
            if not prompt.startswith(held):
                self.counters["agents.template_mismatch"] += 1
                held = held[:_common(held, prompt)]
            added = self.text.encode(prompt[len(held):])
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            held_ids = (episode.first + episode.path.ids) if episode.first is not None else []
            if prompt[:len(held_ids)] != held_ids:
                self.counters["agents.template_mismatch"] += 1
            added = prompt[_common(held_ids, prompt):]
        else:
            raise _Refused(400, "prompt: one text, or one list of token ids")
        prompt_text = prompt if isinstance(prompt, str) else self.text.decode(prompt)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": request.model or "policy", **fingerprint}
        usage_too = bool(request.stream_options and request.stream_options.include_usage)

        def answer(out: Response, text: str) -> dict[str, Any]:
            """The answer's choice: `text` of the turn `out` (all of it, or what a stream has yet to send)."""
            ids = out.token_ids.tolist()
            logprobs = {"tokens": [self.text.decode([t]) for t in ids], "token_logprobs": out.logprobs.tolist(),
                        "top_logprobs": [None] * len(ids), "text_offset": []} if request.logprobs is not None else None
            return {**head, "choices": [{
                "index": 0, "text": text, "logprobs": logprobs, "finish_reason": _FINISH.get(out.finish_reason, "stop"),
                **({"prompt_token_ids": prompt_ids, "token_ids": ids} if request.return_token_ids else {})}]}

        def end(out: Response) -> None:
            episode.text = prompt_text + self.text.decode(out.token_ids.tolist())

        if request.stream and not _stops(request.stop) and self._nursery is not None:  # as the engine makes it
            prompt_ids, live = self._live(episode, added, request.max_tokens, end)

            def delta(text: str) -> dict[str, Any]:
                return {**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}

            async def tail(out: Response, sent: str) -> list[dict[str, Any]]:
                said = self.text.decode(out.token_ids.tolist())
                usage = [{**head, "choices": [], "usage": _usage(prompt_ids, out.token_ids.tolist())}] * usage_too
                return [answer(out, said[len(sent):] if said.startswith(sent) else "")] + usage

            return http.Streamed(self._follow(live, [], delta, tail))
        prompt_ids, out = await self._turn(episode, added, request.max_tokens, _stops(request.stop))
        end(out)
        reply = answer(out, self.text.decode(out.token_ids.tolist()))
        usage = _usage(prompt_ids, out.token_ids.tolist())
        if not request.stream:
            return http.HttpResponse.of(200, {**reply, "usage": usage})
        return http.Streamed(_sse([reply] + [{**reply, "choices": [], "usage": usage}] * usage_too))

    def _sampling(self, body: dict[str, Any], episode: _Episode) -> dict[str, str]:
        """Check that a request asks for the run's sampling or none (`agents.sampling`); the answer's
        fingerprint where it asked for another and is sampled as the run does anyway."""
        engine = getattr(self.engine, "cfg", None)
        temperature = episode.temperature if episode.temperature is not None else getattr(engine, "temperature", 1.0)
        run = {**_NEUTRAL, "top_p": (getattr(engine, "top_p", 1.0),), "temperature": (temperature,)}
        other = [key for key, value in body.items() if key in run and value is not None and value not in run[key]]
        if not other:
            return {}
        if self.cfg.sampling == "run":
            self.counters["agents.sampling_ignored"] += 1
            return {"system_fingerprint": RUN_SAMPLING}
        key = other[0]
        raise _Refused(400, f"{key} {body[key]!r}: this run samples at {key} {run[key][0]!r}, the policy trains on "
                            "what it samples; leave it out (or set agents.sampling = \"run\" to be sampled as the "
                            "run does)")

    async def _turn(self, episode: _Episode, added: list[int], asked: int | None,
                    stops: Sequence[str] = ()) -> tuple[list[int], Response]:
        """Generate one turn of `episode` after the tokens `added` (the agent's since its last turn), ended
        before the first of `stops` in its text; the tokens it was generated over, and the turn."""
        first, added, prompt, cap = self._room(episode, added, asked)
        return prompt, await self._generate(episode, first, added, prompt, cap, stops)

    def _live(self, episode: _Episode, added: list[int], asked: int | None, after: Any) -> tuple[list[int], _Live]:
        """`_turn` without stop strings, run beside the request so that its answer streams the tokens as the
        engine makes them; `after(out)` once the turn is the episode's (whether or not its agent still
        listens). What would refuse the turn before it starts is raised here, as an answer's status."""
        first, added, prompt, cap = self._room(episode, added, asked)
        live = _Live()

        async def turn() -> None:
            try:
                live.out = await self._generate(episode, first, added, prompt, cap, (), live.update)
                after(live.out)
            except _Refused as refused:
                live.refused = refused
            except (EngineDead, GrantOverrun) as exc:  # the endpoint ends (its nursery's error): say why first
                live.refused = _Refused(503, f"{type(exc).__name__}: {exc}", "endpoint_ended")
                raise
            except Exception as exc:  # the turn's fault, as a handler's: its agent hears of it, the endpoint stays up
                http.log.exception("[agents] a streamed turn of %s failed", episode.id)
                live.refused = _Refused(500, f"{type(exc).__name__}: {exc}", "internal_error")
            finally:
                live.done = True
                live.changed.set()

        assert self._nursery is not None
        self._nursery.start_soon(turn)
        return prompt, live

    def _room(self, episode: _Episode, added: list[int], asked: int | None) -> tuple[list[int], list[int], list[int],
                                                                                         int]:
        """Whether `episode` may have a turn after `added` (else refused), and its (first prompt, tokens
        added, whole prompt, most tokens it may have)."""
        if episode.turns >= self.cfg.max_turns:
            episode.cut = FinishReason.TURNS
            raise _Refused(400, f"episode {episode.id} has had its {self.cfg.max_turns} turns (agents.max_turns): "
                                "end it", "episode_over")
        if episode.first is None:
            first, added = added, []
        else:
            first = episode.first
        room = self.cfg.max_tokens - len(episode.path.ids) - len(added)
        if room <= 0:
            episode.cut = FinishReason.LENGTH
            raise _Refused(400, f"episode {episode.id} has no tokens left (agents.max_tokens = "
                                f"{self.cfg.max_tokens}): end it", "episode_over")
        cap = min(self.turn_tokens, room, asked or self.turn_tokens)
        prompt = first + episode.path.ids + added
        if context := getattr(self.engine, "context", None):  # the longest sequence the engine takes
            if len(prompt) >= context:
                raise _Refused(400, f"the prompt is {len(prompt)} tokens, the model's context {context}: nothing "
                                    "is left to generate; shorten it", "context_length_exceeded")
            cap = min(cap, context - len(prompt))
        return first, added, prompt, cap

    async def _generate(self, episode: _Episode, first: list[int], added: list[int], prompt: list[int], cap: int,
                        stops: Sequence[str], on_tokens: Any = None) -> Response:
        episode.busy = True
        scope = trio.CancelScope()
        self._turning.add(scope)
        try:
            held = episode.group.group.min_version if episode.group is not None else 0
            with scope:
                out = await self.engine.generate(prompt, max_tokens=cap, min_version=held,
                                                 temperature=episode.temperature, on_tokens=on_tokens)
        finally:
            self._turning.discard(scope)
            episode.busy = False
            episode.last = trio.current_time()
        if scope.cancelled_caught:
            raise _Refused(410, f"the run is over ({self.over}): stop", "run_over")
        if out.error is not None:
            self.counters["agents.failed_turns"] += 1
            raise _Refused(500, f"the engine failed on this turn: {out.error}", "engine_error")
        if episode.result is not None or episode.id not in self.episodes:
            raise _Refused(410, f"episode {episode.id} was abandoned while its turn ran", "episode_gone")
        if stops and (keep := self.text.before_stop(out.token_ids.tolist(), stops)) is not None:
            out = _cut(out, keep)  # what followed was sampled, but neither the agent nor the trainer sees it
        if episode.first is None:
            episode.first = first
            episode.path.started = time.time()
        episode.path.observe(added, episode.path.versions[-1] if episode.path.versions else self.engine.version)
        episode.path.add(out, model=True)
        episode.turns += 1
        if out.finish_reason == FinishReason.LENGTH:
            episode.cut = FinishReason.LENGTH
        self.counters["episode_turns"] += 1
        return out

    async def _parser(self, tools: list[dict[str, Any]]) -> Any:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._parsers:
            made = await trio.to_thread.run_sync(self.make_parser, tools)  # vLLM's parsers: a heavy first import
            if len(self._parsers) > 64:
                self._parsers.clear()
            self._parsers[key] = made
        return self._parsers[key]


def _assemble(held: _Group, version: int) -> tuple[PromptGroup, list[Response]]:
    """The finished group: its prompt the part its episodes' first prompts share, each episode's
    sample the rest of its first prompt (loss mask 0) and its trajectory."""
    played = [(e, r) for e, r in zip(held.episodes, held.results) if r.error is None]
    firsts = [e.first for e, _ in played]
    shared = firsts[0] if firsts else list(held.group.prompt_ids)
    for first in firsts[1:]:
        shared = shared[:_common(shared, first)]
    responses = list(held.results)
    for episode, result in played:
        rest = episode.first[len(shared):]
        if rest:
            start = int(result.versions[0]) if len(result.versions) else version
            responses[episode.index] = dataclasses.replace(
                result, token_ids=np.concatenate([np.asarray(rest, np.int32), result.token_ids]),
                logprobs=np.concatenate([np.zeros(len(rest), np.float32), result.logprobs]),
                versions=np.concatenate([np.full(len(rest), start, np.int32), result.versions]),
                loss_mask=np.concatenate([np.zeros(len(rest), np.uint8), result.loss_mask]))
    return msgspec.structs.replace(held.group, prompt_ids=list(shared)), responses


def _stops(stop: str | list[str] | None) -> list[str]:
    """A request's `stop`, as strings."""
    return [stop] if isinstance(stop, str) else list(stop or [])


def _cut(out: Response, keep: int) -> Response:
    """A turn's first `keep` tokens, stopped (at a stop string)."""
    mask = out.loss_mask[:keep] if out.loss_mask is not None else None
    return dataclasses.replace(out, token_ids=out.token_ids[:keep], logprobs=out.logprobs[:keep],
                               versions=out.versions[:keep], loss_mask=mask, finish_reason=FinishReason.STOP)


def _usage(prompt_ids: list[int], ids: list[int]) -> dict[str, int]:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids), "total_tokens": len(prompt_ids) + len(ids)}


def _common(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _message(m: Any) -> dict[str, Any]:
    """A request's chat message as the chat template reads it: text content, tool calls' arguments as
    objects (as vLLM's own server passes them)."""
    m = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        m["content"] = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = m.get("tool_calls")
    if calls:
        m["tool_calls"] = [dict(call) for call in calls]
        for call in m["tool_calls"]:
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass
            call["function"] = function
    return m


def _requests() -> tuple[Any, Any, Any]:
    """vLLM's request models and its client error (`compat.openai_requests`): imported here, not with this
    module, which every rollout replica loads (torch's import costs a simulated replica 3 s of CPU)."""
    from rlflow.services import compat

    return compat.openai_requests()


def _validated(model: Any, body: Any) -> Any:
    import pydantic

    client_error = _requests()[2]

    if not isinstance(body, dict):
        raise _Refused(400, "the request body is not a JSON object")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise _Refused(400, f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg"))) from None
    except (ValueError, client_error) as exc:  # vLLM's own checks of a request
        raise _Refused(400, str(exc)) from None


def _body(request: http.HttpRequest) -> dict[str, Any]:
    """The request's JSON object (empty: no body)."""
    try:
        body = request.json() or {}
    except ValueError as exc:
        raise _Refused(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _Refused(400, f"the request body is a JSON {type(body).__name__}, not an object")
    return body


async def _sse(events: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for event in events:
        yield _data(event)
    yield b"data: [DONE]\n\n"


def _data(event: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _plain(row: Any) -> dict[str, Any]:
    """A task row as JSON can carry it."""
    return json.loads(json.dumps(dict(row), default=_jsonable))


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _own_address() -> str:
    from rlflow.data.net import node_ip

    return node_ip()


def _die_with_parent() -> None:
    """In the agent's process before it runs: it is killed when this replica's process dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
