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
request's body is checked by vLLM's own request models and answered by its
response models (`openai_api`), its tool calls read by vLLM's parsers, its
chat by the model's template. The episodes themselves are kept by a plain
state machine (`agent_book.AgentBook`); this module serves HTTP, runs the
engine, waits, and starts the agent programs.

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
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from rlflow.env.render import EpisodeText, RenderError
from rlflow.protocol import FinishReason, PromptGroup, Response
from rlflow.services.rollout import http, openai_api
from rlflow.services.rollout.agent_book import ABANDONED, AgentBook, AgentEpisode, Refused, common
from rlflow.services.rollout.engine import EngineDead
from rlflow.services.rollout.openai_api import FINISH, ChatAnswer, CompletionAnswer
from rlflow.services.rollout.source import GivenUp, GrantOverrun, episode_metrics, hand_back

#: The fingerprint of an answer sampled as the run does where the request asked otherwise (`agents.sampling`).
RUN_SAMPLING = "rlflow-run-sampling"
#: Sampling fields a request may give, with the values that change nothing (top_p and temperature: the run's).
_NEUTRAL: dict[str, tuple[Any, ...]] = {"top_k": (-1, 0), "min_p": (0,), "presence_penalty": (0,),
                                        "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},)}


@dataclass
class _Live:
    """A turn under way that a streamed answer follows: its tokens so far, then how it ended."""

    ids: list[int] = field(default_factory=list)
    out: Response | None = None
    refused: Refused | None = None
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
    """The endpoint of one rollout replica, and the agents it starts (see the module): an `EpisodeSource`.
    Finished groups come out of `finished`; groups given up on (dropped), out of `given_up`."""

    def __init__(self, engine: Any, task: Any, cfg: Any, *, text: EpisodeText, make_parser: Any, turn_tokens: int,
                 counters: Counter[str], api_key: str, rank: int, replicas: int, takes_reward: bool,
                 holds: int, import_dir: str = "", log: Any = None):
        self.engine, self.task, self.cfg, self.text = engine, task, cfg, text
        self.make_parser = make_parser
        self.counters, self.key = counters, api_key
        self.rank, self.replicas = rank, replicas
        self.import_dir, self.log = import_dir, log
        self.book = AgentBook(cfg, counters, turn_tokens=min(turn_tokens, cfg.turn_tokens or turn_tokens),
                              takes_reward=takes_reward, now=trio.current_time)
        # As many as the controller lets this replica hold (`groups_held`): finished and abandoned groups wait
        # for the replica's loop here (`hand_back`).
        self._send, self.finished = trio.open_memory_channel(holds)
        self._given_up_send, self.given_up = trio.open_memory_channel(holds)
        self._queued = trio.Event()  # set when episodes are queued, or the run ends
        self._ended = trio.Event()  # set when an episode ends
        self._parsers: dict[str, Any] = {}
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
        await trio.to_thread.run_sync(lambda: (openai_api.requests(), openai_api.answers()))
        async with self._send, self._given_up_send, trio.open_nursery() as nursery:
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

    def queues(self) -> dict[str, int]:
        return {"episode_groups": self.book.groups, "agent_sessions": self.book.sessions}

    def follow(self, addresses: list[str]) -> None:
        """Nothing to follow: the agents come to the endpoint."""

    def submit(self, group: PromptGroup, issued_at: float) -> None:
        """Hand out the group's `n` episodes."""
        prompt = self.task.decode(np.asarray(group.prompt_ids, np.int64)) if group.prompt_ids else ""
        self.book.hand_out(group, issued_at, _plain(self.task.row(group.group_id)), prompt)
        self._wake()

    async def evaluate(self, rows: Sequence[tuple[dict[str, Any], str]], concurrency: int, temperature: float
                       ) -> dict[str, float]:
        """One episode of each held-out (row, reference), handed out first, at `temperature`; the
        agents' rewards make the metrics (`source.episode_metrics`); one abandoned counts unsolved."""
        prompts = self.task.heldout_prompts() if hasattr(self.task, "heldout_prompts") else [[]] * len(rows)
        played = self.book.hand_out_first(
            [(_plain(row), reference, self.task.decode(np.asarray(prompts[i], np.int64)))
             for i, (row, reference) in enumerate(rows)], temperature)
        self._wake()
        while any(e.result is None for e in played):
            await self._ended.wait()
        return episode_metrics([e.result for e in played if e.result is not None], self.cfg.max_turns)

    def _wake(self) -> None:
        self._queued.set()
        self._queued = trio.Event()

    def _tell_ended(self) -> None:
        self._ended.set()
        self._ended = trio.Event()

    async def _reap(self) -> None:
        """Give up on episodes idle for `idle_timeout_s`: their groups are dropped."""
        while True:
            await trio.sleep(min(1.0, self.cfg.idle_timeout_s / 4))
            abandoned, ended = self.book.idle()
            for group_id, why in abandoned:
                hand_back(self._given_up_send, GivenUp(group_id, why, again=False, reason=ABANDONED))
            if ended:
                self._tell_ended()

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
                raise Refused(410, f"the run is over ({self.over}): stop", "run_over")
            return await self._route(request, path)
        except Refused as refused:
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
            raise Refused(405, f"{request.method} {path}: not served here")
        if route == "/rlflow/episodes":
            return await self._take(request)
        if len(parts) == 4 and parts[:2] == ["rlflow", "episodes"] and parts[3] == "end":
            return self._finish(parts[2], openai_api.body(request))
        if route == "/v1/chat/completions":
            return await self._chat(openai_api.body(request), episode_id)
        if route == "/v1/completions":
            return await self._complete(openai_api.body(request), episode_id)
        raise Refused(404, f"POST {path}: no such route (see docs/agents.md)")

    async def _take(self, request: http.HttpRequest) -> http.HttpResponse:
        wait = openai_api.body(request).get("wait_s", 30.0)
        if not isinstance(wait, (int, float)) or not math.isfinite(wait):
            raise Refused(400, f"wait_s {wait!r}: expected a number of seconds")
        with trio.move_on_after(max(0.0, min(wait, 300.0))):
            while not self.book.queue and not self.over:
                await self._queued.wait()
        if self.over:
            raise Refused(410, f"the run is over ({self.over}): stop", "run_over")
        episode = self.book.take()
        if episode is None:
            return http.HttpResponse(204, headers=[(http.QUEUED, "0")])
        answer = http.HttpResponse.of(200, {
            "id": episode.id, "base_url": f"{self.url}/episodes/{episode.id}/v1", "row": episode.row,
            "prompt": episode.prompt, "reference": episode.reference, "eval": episode.group is None,
            "max_turns": self.cfg.max_turns})
        answer.headers.append((http.QUEUED, str(len(self.book.queue))))
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
            raise Refused(400, f"wait_s {wait!r}, above {above!r}: expected seconds and a count")
        with trio.move_on_after(max(0.0, min(seconds, 300.0))):
            while len(self.book.queue) <= most and not self.over:
                await self._queued.wait()
        if self.over:
            raise Refused(410, f"the run is over ({self.over}): stop", "run_over")
        answer = http.HttpResponse.of(200, {"queued": len(self.book.queue)})
        answer.headers.append((http.QUEUED, str(len(self.book.queue))))
        return answer

    def _finish(self, episode_id: str, body: dict[str, Any]) -> http.HttpResponse:
        done = self.book.finish(episode_id, body.get("reward"), self.engine.version)
        self._tell_ended()
        if done is not None:
            hand_back(self._send, [done])
        return http.HttpResponse.of(200, {"id": episode_id, "ended": True})

    # -- turns --------------------------------------------------------------------------------------

    async def _chat(self, body: dict[str, Any], episode_id: str) -> http.HttpResponse | http.Streamed:
        request = openai_api.validated(openai_api.requests()[0], body)
        episode = self.book.episode(episode_id or request.user or "")
        fingerprint = self._sampling(body, episode)
        messages = [openai_api.message(m) for m in request.messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        choice = "auto" if request.tool_choice is None else getattr(request.tool_choice, "type", request.tool_choice)
        if tools and choice not in ("auto", "none"):
            raise Refused(400, f"tool_choice {request.tool_choice!r}: the model's tool calls are read from what it "
                               "says, never forced; send \"auto\" or \"none\"")
        try:
            whole = self.text.encode(self.text.render(messages, tools, generation=True))
            if episode.first is None:
                added = whole
            else:
                if len(messages) < episode.seen:
                    raise Refused(400, f"episode {episode.id} holds {episode.seen} messages; this request has "
                                       f"{len(messages)}: send the whole conversation, each turn's reply included")
                # (no new message: the template's next generation prompt alone)
                added = self.text.following(messages[episode.seen:], tools)
                if whole != episode.first + episode.path.ids + added:
                    self.counters["agents.template_mismatch"] += 1
        except RenderError as exc:
            raise Refused(400, str(exc)) from None
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        usage_too = bool(request.stream_options and request.stream_options.include_usage)
        stops = openai_api.stops(request.stop)
        seen, created = len(messages) + 1, int(time.time())

        def answer(prompt_ids: list[int]) -> ChatAnswer:
            return ChatAnswer(request.model or "policy", prompt_ids, request.logprobs, request.return_token_ids,
                              self.text.decode, fingerprint, created)

        if request.stream and not tools and not stops and self._nursery is not None:
            # Streamed as the engine makes it (where a stop string or a tool call starts is known only at the end).
            prompt_ids, live = self._live(episode, added, asked, lambda out: setattr(episode, "seen", seen))
            streamed = answer(prompt_ids)

            def tail(out: Response, sent: str) -> list[Any]:
                content = self.text.decode(out.token_ids.tolist())
                rest = content[len(sent):] if content.startswith(sent) else ""
                return ([streamed.delta(rest)] * bool(rest)
                        + streamed.end(out, FINISH.get(out.finish_reason, "stop"), usage_too))

            return http.Streamed(self._follow(live, [streamed.first()], streamed.delta, tail))
        prompt_ids, out = await self._turn(episode, added, asked, stops)
        episode.seen = seen
        ids = out.token_ids.tolist()
        content, calls = self.text.decode(ids), []
        if tools and choice == "auto" and self.cfg.tool_parser and self.make_parser is not None:
            parse = await self._parser(tools)
            found, _, rest = parse(self.text.tokenizer.decode(ids, skip_special_tokens=False))
            if found:
                calls = [{"id": call_id or f"call_{secrets.token_hex(12)}", "type": "function",
                          "function": {"name": name, "arguments": arguments}} for name, arguments, call_id in found]
                content = rest or None
        finish = "tool_calls" if calls else FINISH.get(out.finish_reason, "stop")
        if not request.stream:
            return openai_api.whole(answer(prompt_ids).whole(out, content, calls, finish))
        return http.Streamed(openai_api.stream(answer(prompt_ids).events(out, content, calls, finish, usage_too)))

    async def _follow(self, live: _Live, head: list[Any], delta: Any, tail: Any) -> AsyncIterator[bytes]:
        """The events of a turn under way as it goes: `head`, a `delta(text)` whenever its text grows, then
        `tail(out, text sent)`; an error event if the turn is refused (the run ended, its engine failed)."""
        for value in head:
            yield openai_api.event(value)
        sent = ""
        while not live.done:
            await live.next()
            text = self.text.decode(live.ids)
            # A character still incomplete in its bytes waits for the token that completes it.
            more = text[len(sent):].rstrip("\ufffd") if text.startswith(sent) else ""
            if more:
                sent += more
                yield openai_api.event(delta(more))
        if live.out is None:
            refused = live.refused or Refused(500, "the turn ended with no answer", "engine_error")
            yield openai_api.event({"error": {"message": str(refused), "type": refused.kind, "code": refused.kind,
                                              "status": refused.status}})
        else:
            for value in tail(live.out, sent):
                yield openai_api.event(value)
        yield openai_api.DONE

    async def _complete(self, body: dict[str, Any], episode_id: str) -> http.HttpResponse | http.Streamed:
        request = openai_api.validated(openai_api.requests()[1], body)
        episode = self.book.episode(episode_id or request.user or "")
        fingerprint = self._sampling(body, episode)
        if (request.n or 1) != 1:
            raise Refused(400, "n must be 1: an episode is one sequence")
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            held = episode.text if episode.first is not None else ""
            if not prompt.startswith(held):
                self.counters["agents.template_mismatch"] += 1
                held = held[:common(held, prompt)]
            added = self.text.encode(prompt[len(held):])
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            held_ids = (episode.first + episode.path.ids) if episode.first is not None else []
            if prompt[:len(held_ids)] != held_ids:
                self.counters["agents.template_mismatch"] += 1
            added = prompt[common(held_ids, prompt):]
        else:
            raise Refused(400, "prompt: one text, or one list of token ids")
        prompt_text = prompt if isinstance(prompt, str) else self.text.decode(prompt)
        usage_too = bool(request.stream_options and request.stream_options.include_usage)
        stops, created = openai_api.stops(request.stop), int(time.time())

        def answer(prompt_ids: list[int]) -> CompletionAnswer:
            return CompletionAnswer(request.model or "policy", prompt_ids, request.logprobs, request.return_token_ids,
                                    self.text.decode, fingerprint, created)

        def end(out: Response) -> None:
            episode.text = prompt_text + self.text.decode(out.token_ids.tolist())

        if request.stream and not stops and self._nursery is not None:  # as the engine makes it
            prompt_ids, live = self._live(episode, added, request.max_tokens, end)
            streamed = answer(prompt_ids)

            def tail(out: Response, sent: str) -> list[Any]:
                said = self.text.decode(out.token_ids.tolist())
                return streamed.end(out, said[len(sent):] if said.startswith(sent) else "", usage_too)

            return http.Streamed(self._follow(live, [], streamed.delta, tail))
        prompt_ids, out = await self._turn(episode, added, request.max_tokens, stops)
        end(out)
        said = self.text.decode(out.token_ids.tolist())
        if not request.stream:
            return openai_api.whole(answer(prompt_ids).whole(out, said))
        return http.Streamed(openai_api.stream(answer(prompt_ids).end(out, said, usage_too)))

    def _sampling(self, body: dict[str, Any], episode: AgentEpisode) -> str | None:
        """Check that a request asks for the run's sampling or none (`agents.sampling`); the answer's
        fingerprint where it asked for another and is sampled as the run does anyway."""
        engine = getattr(self.engine, "cfg", None)
        temperature = episode.temperature if episode.temperature is not None else getattr(engine, "temperature", 1.0)
        run = {**_NEUTRAL, "top_p": (getattr(engine, "top_p", 1.0),), "temperature": (temperature,)}
        other = [key for key, value in body.items() if key in run and value is not None and value not in run[key]]
        if not other:
            return None
        if self.cfg.sampling == "run":
            self.counters["agents.sampling_ignored"] += 1
            return RUN_SAMPLING
        key = other[0]
        raise Refused(400, f"{key} {body[key]!r}: this run samples at {key} {run[key][0]!r}, the policy trains on "
                           "what it samples; leave it out (or set agents.sampling = \"run\" to be sampled as the "
                           "run does)")

    async def _turn(self, episode: AgentEpisode, added: list[int], asked: int | None,
                    stops: Sequence[str] = ()) -> tuple[list[int], Response]:
        """Generate one turn of `episode` after the tokens `added` (the agent's since its last turn), ended
        before the first of `stops` in its text; the tokens it was generated over, and the turn."""
        first, added, prompt, cap = self.book.room(episode, added, asked, getattr(self.engine, "context", None))
        return prompt, await self._generate(episode, first, added, prompt, cap, stops)

    def _live(self, episode: AgentEpisode, added: list[int], asked: int | None, after: Any
              ) -> tuple[list[int], _Live]:
        """`_turn` without stop strings, run beside the request so that its answer streams the tokens as the
        engine makes them; `after(out)` once the turn is the episode's (whether or not its agent still
        listens). What would refuse the turn before it starts is raised here, as an answer's status."""
        first, added, prompt, cap = self.book.room(episode, added, asked, getattr(self.engine, "context", None))
        live = _Live()

        async def turn() -> None:
            try:
                live.out = await self._generate(episode, first, added, prompt, cap, (), live.update)
                after(live.out)
            except Refused as refused:
                live.refused = refused
            except (EngineDead, GrantOverrun) as exc:  # the endpoint ends (its nursery's error): say why first
                live.refused = Refused(503, f"{type(exc).__name__}: {exc}", "endpoint_ended")
                raise
            except Exception as exc:  # the turn's fault, as a handler's: its agent hears of it, the endpoint stays up
                http.log.exception("[agents] a streamed turn of %s failed", episode.id)
                live.refused = Refused(500, f"{type(exc).__name__}: {exc}", "internal_error")
            finally:
                live.done = True
                live.changed.set()

        assert self._nursery is not None
        self._nursery.start_soon(turn)
        return prompt, live

    async def _generate(self, episode: AgentEpisode, first: list[int], added: list[int], prompt: list[int],
                        cap: int, stops: Sequence[str], on_tokens: Any = None) -> Response:
        self.book.turn_started(episode)
        scope = trio.CancelScope()
        self._turning.add(scope)
        try:
            held = episode.group.group.min_version if episode.group is not None else 0
            with scope:
                out = await self.engine.generate(prompt, max_tokens=cap, min_version=held,
                                                 temperature=episode.temperature, on_tokens=on_tokens)
        finally:
            self._turning.discard(scope)
            self.book.turn_ended(episode)
        if scope.cancelled_caught:
            raise Refused(410, f"the run is over ({self.over}): stop", "run_over")
        if out.error is not None:
            self.counters["agents.failed_turns"] += 1
            raise Refused(500, f"the engine failed on this turn: {out.error}", "engine_error")
        if stops and (keep := self.text.before_stop(out.token_ids.tolist(), stops)) is not None:
            out = _cut(out, keep)  # what followed was sampled, but neither the agent nor the trainer sees it
        self.book.record(episode, first, added, out, self.engine.version)
        return out

    async def _parser(self, tools: list[dict[str, Any]]) -> Any:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._parsers:
            made = await trio.to_thread.run_sync(self.make_parser, tools)  # vLLM's parsers: a heavy first import
            if len(self._parsers) > 64:
                self._parsers.clear()
            self._parsers[key] = made
        return self._parsers[key]


def _cut(out: Response, keep: int) -> Response:
    """A turn's first `keep` tokens, stopped (at a stop string)."""
    mask = out.loss_mask[:keep] if out.loss_mask is not None else None
    return dataclasses.replace(out, token_ids=out.token_ids[:keep], logprobs=out.logprobs[:keep],
                               versions=out.versions[:keep], loss_mask=mask, finish_reason=FinishReason.STOP)


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
