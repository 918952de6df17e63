"""One address for the agents of every rollout replica (`agents.router`, the ``url`` of agents.json).

Each rollout replica serves its own agents' endpoint (services/rollout/agents.py); an agent fleet that
starts itself would have to spread over their URLs and follow them as replicas restart. The router is
one HTTP endpoint in front of them all, with the same routes and answers (docs/agents.md):

* ``POST /rlflow/episodes`` goes to the replica with the most episodes waiting (each take's answer
  says how many it has left, its `http.QUEUED` header). While none is known to hold one, takes wait
  in the router, and one request a replica (``GET /rlflow/episodes?wait_s=...``, answered once it
  holds an episode) stands for all of them: a thousand waiting agents cost the replicas nothing. The
  answer's ``base_url`` names the router, which remembers whose episode it is.
* An episode's requests (its ``base_url``, ``/v1/...`` with its id as ``user``, ``/end``) go to the
  replica that handed it out, streamed answers chunk by chunk as they come: an episode's tokens live
  in that replica's engine. A replica that is gone (restarted: its episodes' groups are granted
  again) is answered 410 ``episode_gone``, as a replica answers for an episode it no longer holds.

The controller starts it beside the run (`rlflow.control.agents_router`), with the run's [agents]
table and its key in ``RLFLOW_AGENTS``; it prints its URL as its first line, follows the replicas' addresses in
agents.json, which the controller rewrites as each replica says hello, and ends when its standard
input closes (the controller is gone). It carries the agents' bytes and holds nothing of the run: a
router started again asks each replica for an episode it does not know of, and loses only the
requests under way.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import itertools
import json
import logging
import math
import os
import secrets
import sys
from typing import Any

import httpx
import msgspec
import trio

from rlflow import config as C
from rlflow.data.net import node_ip
from rlflow.rundir import RunDir
from rlflow.services.rollout import http

log = logging.getLogger("rlflow.agents")

#: How long a watcher's request waits for its replica to hold more episodes before it asks again.
PEEK_S = 10.0
#: A replica where nothing listens is left out of takes this long (or until agents.json names it again).
RETRY_S = 1.0
#: HTTP clients the requests to the replicas take turns on. An httpx client's pool looks over all its
#: connections at each request: with a thousand agents' requests under way at once (a connection each),
#: one pool spent the router's whole core on that and cut agents off; 32 pools of ~30 do not.
CLIENTS = 32
#: Headers of a replica's answer passed on to the agent (the rest the router's server writes itself).
_PASSED = ("retry-after", "cache-control", http.QUEUED)


class Router:
    """The routes of the module's docstring, over the replicas named in `agents` (agents.json)."""

    def __init__(self, agents: RunDir, key: str, idle_timeout_s: float, clients: list[httpx.AsyncClient]):
        self.run_dir, self.key, self.idle_timeout_s, self.clients = agents, key, idle_timeout_s, clients
        self._next_client = itertools.count()
        self.url = ""
        #: Each replica's endpoint, as agents.json names it now (less those found gone since it changed).
        self.replicas: dict[str, str] = {}
        self._seen: Any = None
        self._changed = trio.Event()
        #: Episodes handed out through the router: id -> (replica, its URL then, last request's time).
        self.owner: dict[str, tuple[str, str, float]] = {}
        #: Episodes each replica was last heard to hold (less the takes on their way to it).
        self.queued: collections.Counter[str] = collections.Counter()
        #: Set (and made anew) when agents.json names other replicas: their watchers start again.
        self._roster = trio.Event()
        #: Why the run ended, once the controller says it has: every request is answered 410 `run_over`.
        self.over = ""
        #: The requests under way, until their answers are written.
        self.drain = http.Drain()
        #: Replicas found with nothing listening, left out of takes until then (trio time).
        self.out_until: dict[str, float] = {}
        self._turn = itertools.count()

    async def run(self, sock: Any, limits: http.Limits, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow)
            nursery.start_soon(self._forget)
            nursery.start_soon(self._watch)
            await nursery.start(functools.partial(http.serve, limits=limits, drain=self.drain), self.handle, sock)
            task_status.started()

    # -- the replicas and their episodes ----------------------------------------------------------

    async def _follow(self) -> None:
        """Keep `replicas` as agents.json names them (the controller rewrites it at each replica's hello)."""
        while True:
            try:
                stat = os.stat(self.run_dir.agents)
                seen = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            except FileNotFoundError:
                seen = None
            if seen != self._seen and seen is not None:
                info = self.run_dir.read_agents()
                if info is not None:
                    self._seen, self.replicas = seen, dict(info.urls)
                    self.out_until.clear()
                    self._roster.set()
                    self._roster = trio.Event()
                    self._wake()
            await trio.sleep(0.1)

    def _left_out(self, name: str, url: str) -> None:
        """Nothing listens for `name` at `url` (it died): no takes go to it for `RETRY_S`, or until
        agents.json names it again."""
        if self.replicas.get(name) == url and self.out_until.get(name, 0.0) <= trio.current_time():
            log.warning("[agents] router: nothing listens for %s at %s; left out for %g s, or until it is back",
                        name, url, RETRY_S)
            self.out_until[name] = trio.current_time() + RETRY_S
            self.queued.pop(name, None)

    async def _forget(self) -> None:
        """Episodes with no request for twice the idle timeout were abandoned by their replica."""
        while True:
            await trio.sleep(max(0.05, self.idle_timeout_s / 4))
            old = trio.current_time() - 2 * self.idle_timeout_s
            for episode in [e for e, (_, _, last) in self.owner.items() if last < old]:
                del self.owner[episode]

    def _live(self) -> list[tuple[str, str]]:
        """The replicas takes may go to: named in agents.json, and not found with nothing listening."""
        now = trio.current_time()
        return [(name, url) for name, url in self.replicas.items() if self.out_until.get(name, 0.0) <= now]

    def _choose(self) -> tuple[str, str] | None:
        """The replica a take goes to: the one with the most episodes waiting (None: none is known to have
        one), in turn among equals."""
        live = [(name, url) for name, url in self._live() if self.queued[name] > 0]
        if not live:
            return None
        turn = next(self._turn)
        return min(live, key=lambda item: (-self.queued[item[0]], (live.index(item) - turn) % len(live)))

    # -- HTTP ---------------------------------------------------------------------------------------

    async def handle(self, request: http.HttpRequest) -> http.HttpResponse | http.Streamed:
        path = request.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            return http.HttpResponse.of(200, {"ok": True, "replicas": len(self.replicas)})
        if not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {self.key}"):
            return http.HttpResponse.error(
                401, "no valid API key: send the run's key (agents.json) as 'Authorization: Bearer KEY'",
                "invalid_api_key")
        if self.over:
            return _over(self.over)
        parts = path.strip("/").split("/")
        if request.method == "POST" and parts == ["rlflow", "episodes"]:
            return await self._take(request)
        if len(parts) >= 3 and parts[0] == "episodes" and parts[2] == "v1":
            episode = parts[1]
        elif len(parts) == 4 and parts[:2] == ["rlflow", "episodes"] and parts[3] == "end":
            episode = parts[2]
        elif parts[0] == "v1" and request.method == "POST":
            episode = _user(request.body)
        else:  # /v1/models, and what no replica serves either: any replica answers as it would
            live = self._live()
            if not live:
                return _no_replica()
            return await self._pass(request, *live[0], path)
        if not episode:
            return http.HttpResponse.error(
                400, "no episode named: use the episode's base_url, or its id as 'user'", "invalid_request_error")
        held = self.owner.get(episode)
        # One the router does not know of (handed out before it was started again, or long idle) is asked
        # of each replica: one that does not hold it says so, and does nothing else.
        answer: http.HttpResponse | http.Streamed = http.HttpResponse.error(
            410, f"no episode {episode!r} here: it was ended, abandoned, or never handed out", "episode_gone")
        for name, url in [held[:2]] if held is not None else list(self.replicas.items()):
            self.owner[episode] = (name, url, trio.current_time())
            answer = await self._pass(request, name, url, path, episode=episode)
            if not _gone(answer):
                if parts[-1] == "end" and answer.status == 200:
                    del self.owner[episode]
                return answer
            del self.owner[episode]
        return answer

    async def _take(self, request: http.HttpRequest) -> http.HttpResponse | http.Streamed:
        try:
            wait = json.loads(request.body or b"{}").get("wait_s", 30.0)
        except (ValueError, AttributeError):
            wait = None
        if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not math.isfinite(wait):
            return http.HttpResponse.error(400, f"wait_s {wait!r}: expected a number of seconds",
                                           "invalid_request_error")
        deadline = trio.current_time() + max(0.0, min(wait, 300.0))
        while True:
            chosen = self._choose()
            if self.over:
                return _over(self.over)
            if chosen is None:  # none known to hold an episode: wait here (the watchers look for them)
                if trio.current_time() >= deadline:
                    return http.HttpResponse(204)
                with trio.move_on_at(deadline):
                    await self._changed.wait()
                continue
            name, url = chosen
            self.queued[name] -= 1  # this take's; the answer says how many are left
            try:
                answer = await self._send(request, url, "/rlflow/episodes", b'{"wait_s": 0}')
            except httpx.TransportError as exc:  # gone, or the answer cut (an episode it held is abandoned)
                await self._dead(name, url, exc, "a take")
                continue
            self.queued[name] = int(answer.headers.get(http.QUEUED, "0") or 0)
            if answer.status_code == 204:  # another took it first
                continue
            body = await answer.aread()
            if answer.status_code != 200:
                return _response(answer, body)
            episode = json.loads(body)
            self.owner[episode["id"]] = (name, url, trio.current_time())
            episode["base_url"] = f"{self.url}/episodes/{episode['id']}/v1"
            return http.HttpResponse(200, json.dumps(episode).encode(), headers=_headers(answer))

    async def _watch(self) -> None:
        """A watcher for each replica agents.json names, started again as it changes."""
        while True:
            roster = self._roster
            async with trio.open_nursery() as nursery:
                for name, url in self.replicas.items():
                    nursery.start_soon(self._watch_one, name, url)
                await roster.wait()
                nursery.cancel_scope.cancel()

    async def _watch_one(self, name: str, url: str) -> None:
        """Keep `queued[name]` as the replica holds episodes: one request at a time asks it to say when it
        holds more than the router knows of (`GET /rlflow/episodes?above=N&wait_s=...`, which takes
        nothing), so that takes wait here, however many, and go where episodes are as they come."""
        client = self.clients[next(self._next_client) % len(self.clients)]
        while True:
            if (until := self.out_until.get(name, 0.0)) > trio.current_time():
                await trio.sleep_until(until)
            try:
                answer = await client.get(f"{url}/rlflow/episodes", headers={"authorization": f"Bearer {self.key}"},
                                          params={"above": max(0, self.queued[name]), "wait_s": PEEK_S})
            except httpx.ConnectError:
                self._left_out(name, url)
                continue
            except httpx.TransportError:
                await trio.sleep(0.1)
                continue
            if answer.status_code != 200:  # the run is over (410): the takes waiting here hear it from the replica
                self.queued[name] = 1
                self._wake()
                await trio.sleep(RETRY_S)
                continue
            self.queued[name] = int(answer.headers.get(http.QUEUED, "0") or 0)
            if self.queued[name] > 0:
                self._wake()

    def _wake(self) -> None:
        """Takes waiting here look again (an episode came, a replica joined, the run ended)."""
        self._changed.set()
        self._changed = trio.Event()

    async def _pass(self, request: http.HttpRequest, name: str, url: str, path: str, episode: str = ""
                    ) -> http.HttpResponse | http.Streamed:
        """`request` answered by the replica at `url`: its answer as it comes, streamed or whole."""
        try:
            answer = await self._send(request, url, path, request.body)
        except httpx.TransportError as exc:
            if await self._dead(name, url, exc, f"{request.method} {path}"):
                return http.HttpResponse.error(
                    410, f"{name}, which held episode {episode}, is gone (restarted): its group is played again; "
                         "take another episode" if episode else f"{name} is gone: ask again", "episode_gone")
            return http.HttpResponse.error(502, f"{name}'s answer was cut ({type(exc).__name__}): its episode "
                                                "may hold the turn; end it, or take another", "bad_gateway")
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            return http.Streamed(_chunks(answer, name, episode), status=answer.status_code, headers=_headers(answer))
        return _response(answer, await answer.aread())

    async def _dead(self, name: str, url: str, exc: httpx.TransportError, what: str) -> bool:
        """Whether a request to `name` failed with `exc` because the replica is gone (nothing listens, now
        that the request was refused or cut): then it is left out; else the cut is said in the log."""
        if not isinstance(exc, httpx.ConnectError):
            try:
                await self.clients[0].get(f"{url}/health", timeout=5.0)
            except httpx.TransportError:
                pass
            else:
                log.warning("[agents] router: %s to %s was cut (%s: %s)", what, name, type(exc).__name__, exc)
                return False
        self._left_out(name, url)
        return True

    async def _send(self, request: http.HttpRequest, url: str, path: str, body: bytes) -> httpx.Response:
        """`request` sent on to `url` + `path`; its answer's head (the body still to read)."""
        headers = {"authorization": request.headers.get("authorization", ""),
                   "content-type": request.headers.get("content-type", "application/json")}
        client = self.clients[next(self._next_client) % len(self.clients)]
        sent = client.build_request(request.method, url + path, headers=headers, content=body)
        answer = await client.send(sent, stream=True)
        if not answer.headers.get("content-type", "").startswith("text/event-stream"):
            await answer.aread()
            await answer.aclose()
        return answer


def _response(answer: httpx.Response, body: bytes) -> http.HttpResponse:
    return http.HttpResponse(answer.status_code, body, answer.headers.get("content-type", "application/json"),
                             _headers(answer))


def _headers(answer: httpx.Response) -> list[tuple[str, str]]:
    return [(name, answer.headers[name]) for name in _PASSED if name in answer.headers]


async def _chunks(answer: httpx.Response, name: str, episode: str):
    """A streamed answer passed on as it comes; cut on its way (its replica died), it ends as a replica's
    own stream ends on an error: an error event, then ``[DONE]``."""
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        error = {"message": f"{name}, which held episode {episode}, went away during the turn "
                            f"({type(exc).__name__}): take another episode", "type": "episode_gone",
                 "code": "episode_gone", "status": 410}
        yield b"\n\ndata: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n"
    finally:
        await answer.aclose()


def _gone(answer: http.HttpResponse | http.Streamed) -> bool:
    """Whether a replica answered that it holds no such episode (any more)."""
    if not isinstance(answer, http.HttpResponse) or answer.status != 410:
        return False
    try:
        return json.loads(answer.body)["error"]["code"] == "episode_gone"
    except (ValueError, KeyError, TypeError):
        return False


def _user(body: bytes) -> str:
    """The episode a `/v1/...` request names in its `user` field ("" if none)."""
    try:
        user = json.loads(body or b"{}").get("user", "")
    except (ValueError, AttributeError):
        return ""
    return user if isinstance(user, str) else ""


def _over(reason: str) -> http.HttpResponse:
    return http.HttpResponse.error(410, f"the run is over ({reason}): stop", "run_over")


def _no_replica() -> http.HttpResponse:
    answer = http.HttpResponse.error(503, "no rollout replica serves agents yet: ask again", "no_replica")
    answer.headers.append(("retry-after", "1"))
    return answer


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlflow.services.rollout.router",
                                     description="one address for the agents of every rollout replica "
                                                 "(the run's [agents] table, with its key, in RLFLOW_AGENTS)")
    parser.add_argument("--run-dir", required=True, help="the run's directory (its agents.json names the replicas)")
    parser.add_argument("--port", type=int, default=0, help="the port to bind (0: any free one)")
    args = parser.parse_args(argv)
    cfg = msgspec.json.decode(os.environ["RLFLOW_AGENTS"], type=C.AgentsConfig)
    limits = http.Limits(keep_alive_s=cfg.keep_alive_s, read_timeout_s=cfg.read_timeout_s,
                         max_body=cfg.max_body_bytes, max_connections=cfg.max_connections)
    sock = http.bind(cfg.host, args.port)
    host = cfg.host if cfg.host not in ("0.0.0.0", "::", "") else node_ip()
    timeout = httpx.Timeout(None, connect=10.0)
    pool = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.max_connections // CLIENTS + 1)
    async with contextlib.AsyncExitStack() as stack, trio.open_nursery() as nursery:
        clients = [await stack.enter_async_context(httpx.AsyncClient(timeout=timeout, limits=pool))
                   for _ in range(CLIENTS)]
        router = Router(RunDir(args.run_dir), cfg.api_key, cfg.idle_timeout_s, clients)
        router.url = f"http://{host}:{sock.getsockname()[1]}"
        await nursery.start(router.run, sock, limits)
        print(router.url, flush=True)
        # The controller's word: a line with why the run ended (every request is answered 410 from then
        # on, those waiting too), then the end of the stream (it is gone, or done with the router).
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        while said := await stdin.receive_some():
            router.over = said.decode(errors="replace").strip().splitlines()[-1] or "stopped"
            router._wake()
        with trio.move_on_after(limits.grace_s):  # the answers given meanwhile reach their agents
            await router.drain.idle()
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(levelname)s %(message)s")
    trio.run(main)
