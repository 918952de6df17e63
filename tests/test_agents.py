"""Outside agents in whole runs (simulated engines, real services, real HTTP, agent programs on the
`openai` package that the rollout starts); their turns on real vLLM are in test_vllm.py."""

from __future__ import annotations

import pathlib
import sys

import pytest
import trio

from rlflow import config as C
from rlflow.config import ConfigError

AGENT = pathlib.Path(__file__).with_name("agents.py")


def agent_run(tmp_path: pathlib.Path, *overrides: str) -> C.Config:
    from test_controller import sim

    command = [sys.executable, str(AGENT), "--sessions", "8", "--die-once", str(tmp_path / "died")]
    return sim("run.steps=6", "roles.reward.engine={kind=\"env\"}", f"agents.command={command!r}".replace("'", '"'),
               "agents.copies=2", "agents.idle_timeout_s=2.0", "agents.api_key=\"k3y\"",
               "roles.rollout.engine.response_len.median=8", "cluster.heartbeat_timeout_s=5", *overrides)


class RowTask:
    """The endpoint tests' task: a group's row names the group; every prompt reads "p"."""

    def row(self, group_id):
        return {"n": group_id}

    def decode(self, ids):
        return "p"


async def endpoint_on(nursery: trio.Nursery, engine, config: C.Config, ctx, turn_tokens: int):
    """An agents' endpoint over real HTTP on `engine` (a simulated one), both started in `nursery`, the
    key "k3y"; the endpoint and its URL."""
    from rlflow.env.render import EpisodeText
    from rlflow.services.rollout.agents import AgentEndpoint

    endpoint = AgentEndpoint(engine, RowTask(), config.agents, text=EpisodeText(None), make_parser=None,
                             turn_tokens=turn_tokens, counters=ctx.counters, api_key="k3y", rank=0, replicas=1,
                             takes_reward=True, holds=1)
    url = endpoint.bind()
    await nursery.start(engine.run)
    await nursery.start(endpoint.run)
    return endpoint, url


async def test_a_run_trains_on_what_outside_agents_played_and_drops_the_group_of_one_that_died(tmp_path):
    from test_controller import run_in_process

    from rlflow.rundir import RunDir
    from rlflow.tools.audit import audit

    with trio.fail_after(120):
        controller, summary = await run_in_process(agent_run(tmp_path), tmp_path)
    assert summary.state == "stopped", summary.error
    assert (tmp_path / "died").exists()
    rows = RunDir(tmp_path).read_metrics()
    assert [r.step for r in rows] == list(range(6)) and all(r.samples == 16 for r in rows)
    assert all(r.train["episode_turns_mean"] == 2 for r in rows)
    assert summary.groups.dropped.get("abandoned", 0) >= 1
    info = RunDir(tmp_path).read_agents()
    assert info.api_key == "k3y" and list(info.urls) == ["rollout-0"] and info.url.startswith("http://127.0.0.1:")
    events = RunDir(tmp_path).read_status().roles["rollout"].counters.agent_events
    assert events["exits"] >= 1 and events["abandoned"] >= 1 and events["taken"] >= 24
    result = audit(tmp_path)
    assert (result.lost, result.duplicated) == (0, 0), result
    assert result.trained == 6 * 4


async def test_a_run_goes_on_under_clients_that_would_hold_or_break_its_endpoint(tmp_path):
    """Beside the agents, over real HTTP: 1,000 connections held idle, a client that sends a byte a second,
    a 10 MB body, bodies that are not JSON and HTTP that does not parse on every route, a wrong key on
    every route. Each is answered for what it is, and the run trains every group, nothing lost."""
    from conftest import until
    from test_controller import run_in_process
    from test_http import ask, status

    from rlflow.rundir import RunDir
    from rlflow.tools.audit import audit

    answers: dict[str, list[int]] = {}
    held: list[trio.SocketStream] = []

    async def hostile(controller, launcher) -> None:
        await until(lambda: (info := RunDir(tmp_path).read_agents()) is not None and "rollout-0" in info.urls)
        info = RunDir(tmp_path).read_agents()
        host, port = info.urls["rollout-0"].removeprefix("http://").rsplit(":", 1)

        def request(method: str, path: str, body: bytes, key: str = "k3y", length: int | None = None) -> bytes:
            return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n"
                    f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body

        routes = [("POST", "/rlflow/episodes"), ("POST", "/rlflow/episodes/1-0-dead/end"), ("GET", "/v1/models"),
                  ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                  ("POST", "/episodes/1-0-dead/v1/chat/completions")]
        for _ in range(1000):
            held.append(await trio.open_tcp_stream(host, int(port)))
        answers["wrong key"] = [status(await ask(int(port), request(m, p, b"{}", key="nope"))) for m, p in routes]
        answers["not json"] = [status(await ask(int(port), request("POST", p, b"{nope")))
                               for _, p in routes[:2] + routes[3:]]
        answers["not http"] = [status(await ask(int(port), b"GARBAGE\r\n\r\n"))]
        answers["10 MB"] = [status(await ask(int(port), request("POST", "/v1/completions", b"", length=10 << 20)))]
        slow = await trio.open_tcp_stream(host, int(port))
        async with slow:
            await slow.send_all(request("POST", "/v1/completions", b"", length=100))
            with trio.move_on_after(60):
                while True:
                    try:
                        await slow.send_all(b"x")
                    except trio.BrokenResourceError:
                        break
                    with trio.move_on_after(1):
                        if answer := await slow.receive_some():
                            answers["a byte a second"] = [status(answer)]
                            break
        # The run trains on, the 1,000 connections still held, then stops (as `rlflow down` would stop it).
        trained = controller.ledger.steps_done
        await until(lambda: controller.ledger.steps_done >= trained + 4)
        controller.stop_reason = "the hostile clients are done"
        controller.done.set()

    config = agent_run(tmp_path, "agents.read_timeout_s=3", "agents.max_body_bytes=1048576", "run.steps=100000")
    try:
        with trio.fail_after(180):
            _, summary = await run_in_process(config, tmp_path, during=hostile)
    finally:
        for stream in held:
            await stream.aclose()
    assert summary.state == "stopped" and summary.stop_reason == "the hostile clients are done", summary.error
    assert answers == {"wrong key": [401] * 6, "not json": [400] * 5, "not http": [400], "10 MB": [413],
                       "a byte a second": [408]}
    assert len(held) == 1000
    rows = RunDir(tmp_path).read_metrics()
    assert len(rows) >= 4 and [r.step for r in rows] == list(range(len(rows))) and all(r.samples == 16 for r in rows)
    result = audit(tmp_path)
    assert (result.lost, result.duplicated) == (0, 0), result


async def test_a_stop_request_ends_a_run_whose_agents_never_came(tmp_path):
    """No agent takes an episode (none started, by the run or by hand): the run waits in its first
    evaluation, and `rlflow down`'s request ends it there, stopped, instead of waiting to be killed."""
    from conftest import until
    from test_controller import run_in_process

    from rlflow.control.launch import request_stop, resolve

    async def stop(controller, launcher) -> None:
        await until(lambda: controller.state.value == "evaluating")
        assert await trio.to_thread.run_sync(request_stop, tmp_path, "rlflow down")

    config = resolve(agent_run(tmp_path, "agents.command=[]", 'task={kind="arith"}', 'roles.rollout.model="default"'))
    with trio.fail_after(120):
        _, summary = await run_in_process(config, tmp_path, during=stop)
    assert summary.state == "stopped" and summary.stop_reason == "rlflow down" and summary.steps == 0


async def test_agents_that_know_the_routers_address_alone_play_every_replica_and_outlive_restarts(tmp_path):
    """Two rollout replicas; the agents, started by the test, know agents.json's `url` alone (the router):
    one plays each episode at its base URL, one at `/v1` with the episode's id as `user`, one streamed.
    Every replica's episodes are played and trained; a replica killed midway is left out until its next
    incarnation says hello, then served again at its new address; the router killed midway is started
    again at its address and finds the episodes handed out before by asking the replicas; nothing is
    lost."""
    import os
    import signal

    import httpx
    import psutil

    from conftest import until
    from test_controller import run_in_process

    from rlflow.rundir import RunDir
    from rlflow.tools.audit import audit

    agents: list[trio.Process] = []
    seen: list[dict[str, str]] = []
    launchers: list = []
    info_url: list[str] = []

    async def play_and_kill(controller, launcher) -> None:
        launchers.append(launcher)
        await until(lambda: (info := RunDir(tmp_path).read_agents()) is not None and info.url != "")
        info = RunDir(tmp_path).read_agents()
        info_url.append(info.url)
        assert not info.urls or set(info.urls) <= {"rollout-0", "rollout-1"}
        env = {**os.environ, "RLFLOW_AGENTS_URL": info.url, "OPENAI_API_KEY": "k3y"}
        for style in ([], ["--user"], ["--stream"]):
            agents.append(await trio.lowlevel.open_process(
                [sys.executable, str(AGENT), "--sessions", "4", *style], env=env))
        await until(lambda: controller.ledger.steps_done >= 3)
        async with httpx.AsyncClient(timeout=30) as client:  # a route of no episode: any replica answers it
            models = await client.get(f"{info.url}/v1/models", headers={"Authorization": "Bearer k3y"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "policy", models.text
        seen.append(dict(RunDir(tmp_path).read_agents().urls))
        before = controller.roster.replicas[("rollout", 1)].incarnation
        await launcher.crash("rollout", 1)
        await until(lambda: controller.roster.replicas[("rollout", 1)].incarnation > before
                    and controller.roster.replicas[("rollout", 1)].live)
        seen.append(dict(RunDir(tmp_path).read_agents().urls))

        def router() -> psutil.Process | None:
            for process in psutil.Process().children(recursive=True):
                try:
                    if "rlflow.services.rollout.router" in process.cmdline():
                        return process
                except psutil.Error:  # one that ended meanwhile
                    pass
            return None

        async def answers() -> bool:
            try:
                async with httpx.AsyncClient(timeout=5) as client:
                    return (await client.get(f"{info.url}/health")).status_code == 200
            except httpx.TransportError:
                return False

        killed = router()
        killed.kill()
        await until(lambda: (now := router()) is not None and now.pid != killed.pid)
        await until(answers)
        restarted.append(controller.ledger.steps_done)
        await until(lambda: controller.ledger.steps_done >= restarted[0] + 2)

    restarted: list[int] = []
    config = agent_run(tmp_path, "agents.command=[]", "roles.rollout.replicas=2", "run.steps=14")
    try:
        with trio.fail_after(150):
            controller, summary = await run_in_process(config, tmp_path, during=play_and_kill)
    finally:
        for process in agents:
            process.send_signal(signal.SIGKILL)
            await process.wait()
    assert summary.state == "stopped" and summary.steps == 14, summary.error
    assert seen[0]["rollout-1"] != seen[1]["rollout-1"] and seen[0]["rollout-0"] == seen[1]["rollout-0"]
    assert restarted and RunDir(tmp_path).read_agents().url == info_url[0]  # the router's address kept
    # Each agent heard that the run was over (410 run_over, from the router itself once its replicas had
    # stopped) and ended, or was still playing when killed: none failed on its own.
    assert {p.returncode for p in agents} <= {0, -signal.SIGKILL}, [p.returncode for p in agents]
    # Episodes taken from each replica through the router, the restarted one's new incarnation among them.
    taken = {rank: launchers[0].services[("rollout", rank)].counters["agents.taken"] for rank in (0, 1)}
    assert taken[0] > 0 and taken[1] > 0, taken
    result = audit(tmp_path)
    assert (result.lost, result.duplicated) == (0, 0), result
    assert result.trained == 14 * 4


@pytest.mark.parametrize("overrides, key, says", [
    (['roles.env={environment={path="rlflow.env.sim:SimEnv"}, pool="score"}'], "agents", "not both"),
    (['run.staleness_check="strict"'], "run.staleness_check", "admission"),
    (["roles.reward.inline=true"], "roles.reward.inline", "reward role"),
])
def test_agent_configs_that_cannot_run_get_one_clear_line(tmp_path, overrides, key, says):
    with pytest.raises(ConfigError) as caught:
        agent_run(tmp_path, *overrides)
    assert caught.value.key == key and says in str(caught.value)


async def test_requests_the_endpoint_cannot_serve_get_an_error_that_names_what_is_wrong(monkeypatch):
    """Over real HTTP, on the simulated engine: each bad request is answered with its status and a message
    that names the problem, and the episodes go on. vLLM's request models are first loaded off the loop's
    thread, before the endpoint serves (a heavy import that would stop the replica's heartbeats)."""
    import functools
    import threading
    import time

    import httpx

    from rlflow.protocol import PromptGroup
    from rlflow.services.base import standalone_context
    from rlflow.services import compat
    from rlflow.services.rollout.sim import SimEngine

    from rlflow.services.rollout import openai_api

    loaded_in = []
    requests = compat.openai_requests
    monkeypatch.setattr(compat, "openai_requests", lambda: loaded_in.append(threading.current_thread()) or requests())
    openai_api.requests.cache_clear()  # loaded again, as in a replica's process

    config = agent_run(pathlib.Path("/nonexistent"), "agents.command=[]", "agents.max_turns=1",
                       "roles.rollout.engine.step_s=0.001")
    ctx = standalone_context(config, "rollout")

    async def post(path: str, body=None, *, content: bytes | None = None, key: str = "k3y") -> httpx.Response:
        call = functools.partial(httpx.post, url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30,
                                 **({"content": content} if content is not None else {"json": body}))
        return await trio.to_thread.run_sync(call)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            endpoint, url = await endpoint_on(nursery, SimEngine(config.roles.rollout.engine, ctx), config, ctx, 8)
            assert loaded_in and loaded_in[0] is not threading.main_thread()
            assert (await post("/rlflow/episodes", {"wait_s": 0})).status_code == 204  # none yet
            endpoint.submit(PromptGroup(group_id=5, prompt_ids=[1, 2], n=1), time.time())
            wrong = await post("/rlflow/episodes", {"wait_s": 1}, key="nope")
            assert wrong.status_code == 401 and "Authorization: Bearer" in wrong.json()["error"]["message"]
            assert "wait_s" in (await post("/rlflow/episodes", {"wait_s": "soon"})).json()["error"]["message"]
            episode = (await post("/rlflow/episodes", {"wait_s": 1})).json()
            assert episode["row"] == {"n": 5} and episode["base_url"].endswith(f"/episodes/{episode['id']}/v1")
            turn = f"/episodes/{episode['id']}/v1/completions"
            cases = [
                (await post(turn, content=b"{not json"), 400, "not JSON"),
                (await post(turn, [1, 2]), 400, "not an object"),
                (await post(turn, {"model": "policy", "prompt": "p", "n": 2}), 400, "n must be 1"),
                (await post(turn, {"model": "policy"}), 400, "prompt"),
                (await post("/v1/completions", {"model": "policy", "prompt": "p"}), 400, "no episode named"),
                (await post("/episodes/9-9-ffff/v1/completions", {"model": "policy", "prompt": "p"}), 410,
                 "no episode '9-9-ffff'"),
                (await post("/v1/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "p"}],
                                                     "user": episode["id"]}), 400, "no chat template"),
                (await post("/v1/embeddings", {}), 404, "no such route"),
            ]
            for answer, status, says in cases:
                assert answer.status_code == status and says in answer.json()["error"]["message"], answer.text
            done = await post("/v1/completions", {"model": "policy", "prompt": "p", "user": episode["id"],
                                                  "max_tokens": 4})
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] <= 4
            over = await post(turn, {"model": "policy", "prompt": "p" + done.json()["choices"][0]["text"] + "o"})
            assert over.status_code == 400 and "agents.max_turns" in over.json()["error"]["message"]
            no_reward = await post(f"/rlflow/episodes/{episode['id']}/end", {})
            assert no_reward.status_code == 400 and "reward" in no_reward.json()["error"]["message"]
            assert (await post(f"/rlflow/episodes/{episode['id']}/end", {"reward": 1.0})).status_code == 200
            [(group, [response])] = await endpoint.finished.receive()
            assert group.group_id == 5 and response.finish_reason.name == "TURNS"
            assert (await post(f"/rlflow/episodes/{episode['id']}/end", {"reward": 1.0})).status_code == 410
            # The run ends: an agent waiting for an episode, and any request after, hears why.
            waited: list[httpx.Response] = []

            async def wait_for_episode() -> None:
                waited.append(await post("/rlflow/episodes", {"wait_s": 30}))

            nursery.start_soon(wait_for_episode)
            while endpoint.drain.busy < 1:  # the agent is waiting
                await trio.sleep(0.01)
            await endpoint.close("6 steps done")
            assert endpoint.drain.busy == 0  # its answer was written before close returned
            while not waited:  # and its client, in a thread, reads it
                await trio.sleep(0.01)
            assert waited[0].status_code == 410
            assert waited[0].json()["error"] == {"message": "the run is over (6 steps done): stop", "type": "run_over",
                                                 "code": "run_over"}
            after = await post(turn, {"model": "policy", "prompt": "p"})
            assert after.status_code == 410 and after.json()["error"]["code"] == "run_over"
            nursery.cancel_scope.cancel()


def test_check_finds_the_agent_program_or_names_what_is_missing(tmp_path):
    from rlflow.tools.check import CheckError, check

    said = []
    check(agent_run(tmp_path), say=said.append)
    assert any(line.startswith("agents: 2 copies of") for line in said)
    with pytest.raises(CheckError, match=r"agents.command: no file 'nowhere/agent.py'"):
        check(agent_run(tmp_path, 'agents.command=["python", "nowhere/agent.py"]'), say=said.append)
    with pytest.raises(CheckError, match=r"agents.command: no program 'no-such-agent'"):
        check(agent_run(tmp_path, 'agents.command=["no-such-agent"]'), say=said.append)


def test_a_replica_holds_what_the_grants_allow_and_ends_when_they_break_their_rule():
    """The channels groups leave a replica's episodes by hold as many as the controller lets it hold (a
    group is held until the replica acknowledges it, after the channel gives it up): one more ends the
    replica, naming the rule, rather than growing without bound."""
    import trio

    from rlflow.algo.staleness import groups_held
    from rlflow.services.rollout.source import GrantOverrun, hand_back

    assert groups_held(64, 8) == 128 and groups_held(0, 8) == 16 and groups_held(1, 64) == 1
    send, receive = trio.open_memory_channel(2)
    hand_back(send, "a")
    hand_back(send, "b")
    with pytest.raises(GrantOverrun, match="more than 2 groups came back .* lets it hold 2"):
        hand_back(send, "c")
    assert [receive.receive_nowait(), receive.receive_nowait()] == ["a", "b"]
    hand_back(send, "c")  # taken: room again


async def test_a_streamed_turn_sends_each_token_as_the_engine_makes_it():
    """Over real HTTP: the simulated engine's turn played back a token at a time through `on_tokens`, each
    next token made only once the client has read the last one: a streamed completion arrives a token an
    event, then its finish with the turn's token ids; the text read is the turn's (chat streams the same
    way: test_vllm.py, on real vLLM). A turn with stop strings comes whole at its end (where it stops is known only
    then), and a run that ends under a streamed turn says so in the stream."""
    import dataclasses
    import json
    import time

    import httpx
    from conftest import until

    from rlflow.protocol import PromptGroup
    from rlflow.services.base import standalone_context
    from rlflow.services.rollout.sim import SimEngine

    config = agent_run(pathlib.Path("/nonexistent"), "agents.command=[]", "agents.max_turns=4",
                       "roles.rollout.engine.step_s=0.001", "roles.rollout.engine.response_len.median=6")
    ctx = standalone_context(config, "rollout")
    read = trio.Semaphore(0)  # released by the client at each event it reads
    stuck = trio.Event()  # set: the next turn's engine stops after its first token until the run ends

    class Stepped(SimEngine):
        async def generate(self, prompt_ids, *, max_tokens, min_version=0, temperature=None, on_tokens=None):
            out = await super().generate(prompt_ids, max_tokens=max_tokens, min_version=min_version,
                                         temperature=temperature)
            # Letters (the simulated engine's tokens are any bytes): each token a character of the text.
            out = dataclasses.replace(out, token_ids=out.token_ids % 26 + ord("a"))
            for n in range(1, len(out.token_ids)):
                if on_tokens is not None:
                    on_tokens(out.token_ids[:n].tolist())
                    if stuck.is_set():
                        await trio.sleep_forever()
                    await read.acquire()
            return out

    async def events(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
        got = []
        async with client.stream("POST", path, json={"model": "policy", "stream": True, **body}) as answer:
            assert answer.status_code == 200, (await answer.aread()).decode()
            async for line in answer.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got.append(json.loads(line.removeprefix("data: ")))
                    if got[-1].get("choices") and got[-1]["choices"][0]["finish_reason"] is None:
                        read.release()  # a token's event: the engine may make the next
        return got

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            endpoint, url = await endpoint_on(nursery, Stepped(config.roles.rollout.engine, ctx), config, ctx, 16)
            endpoint.submit(PromptGroup(group_id=1, prompt_ids=[1, 2], n=1), time.time())
            async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer k3y"}, timeout=30) as client:
                episode = (await client.post("/rlflow/episodes", json={"wait_s": 5})).json()
                base = f"/episodes/{episode['id']}/v1"
                got = await events(client, f"{base}/completions", {"prompt": "p", "return_token_ids": True})
                *deltas, last = got
                ids = last["choices"][0]["token_ids"]
                # A token an event; the last token's comes with the finish.
                assert len(ids) >= 2 and len(deltas) == len(ids) - 1, got
                assert [d["choices"][0]["finish_reason"] for d in deltas] == [None] * len(deltas)
                assert "".join(e["choices"][0]["text"] for e in got) == bytes(ids).decode(errors="replace")
                assert last["choices"][0]["finish_reason"] in ("stop", "length")

                whole = await events(client, f"{base}/completions", {"prompt": "p", "stop": ["\x00"]})
                assert len(whole) == 1  # with a stop string: whole at its end

                stuck.set()
                ended = []

                async def under_way() -> None:
                    ended.extend(await events(client, f"{base}/completions", {"prompt": "p"}))

                nursery.start_soon(under_way)
                await read.acquire()  # its first token's event read, the engine stuck after it
                await endpoint.close("stopped here")
                await until(lambda: ended)
            assert ended[-1]["error"]["code"] == "run_over" and "stopped here" in ended[-1]["error"]["message"]
            nursery.cancel_scope.cancel()


def _turn(ids: list[int], version: int = 3):
    import numpy as np

    from rlflow.protocol import FinishReason, Response

    return Response(token_ids=np.asarray(ids, np.int32), logprobs=np.full(len(ids), -0.5, np.float32),
                    versions=np.full(len(ids), version, np.int32), finish_reason=FinishReason.STOP,
                    loss_mask=np.ones(len(ids), np.uint8))


def test_the_episode_book_is_a_state_machine_on_the_clock_it_is_given():
    """Every transition of an agent's episode, with no loop and no HTTP: handed out, taken, one request
    at a time, its turns recorded token for token, the group whole once both agents end theirs; a
    group with an idle episode abandoned by the clock alone; a held-out episode first in line."""
    from collections import Counter

    from rlflow.protocol import PromptGroup
    from rlflow.services.rollout.agent_book import ABANDONED, AgentBook, Refused

    clock = [100.0]
    cfg = C.AgentsConfig(max_turns=2, max_tokens=12, idle_timeout_s=5.0)
    book = AgentBook(cfg, Counter(), turn_tokens=4, takes_reward=True, now=lambda: clock[0])
    book.hand_out(PromptGroup(group_id=7, prompt_ids=[1], n=2), 0.0, {"n": 7}, "p")
    a, b = book.take(), book.take()
    assert (a.index, b.index, book.take(), book.sessions, book.groups) == (0, 1, None, 2, 1)

    with pytest.raises(Refused, match="no episode 'nope'") as gone:
        book.episode("nope")
    assert (gone.value.status, gone.value.kind) == (410, "episode_gone")
    first, added, prompt, cap = book.room(book.episode(a.id), [1, 2, 3], None, context=None)
    assert (first, added, prompt, cap) == ([1, 2, 3], [], [1, 2, 3], 4)
    book.turn_started(a)
    with pytest.raises(Refused, match="one request at a time") as busy:
        book.episode(a.id)
    assert busy.value.status == 409
    clock[0] = 103.0
    book.turn_ended(a)
    book.record(a, first, added, _turn([9, 9]), version=3)
    _, added, prompt, cap = book.room(a, [5], 10, context=8)
    assert (added, prompt, cap) == ([5], [1, 2, 3, 9, 9, 5], 2)  # the model's context leaves 2
    book.record(a, first, added, _turn([8], version=4), version=4)
    with pytest.raises(Refused, match="had its 2 turns"):
        book.room(a, [], None, None)
    with pytest.raises(Refused, match="scored by its agent"):
        book.finish(a.id, None, version=4)
    assert book.finish(a.id, 1.0, version=4) is None  # b still plays
    with pytest.raises(Refused, match="ended, abandoned"):
        book.episode(a.id)

    book.record(b, [1, 2, 4], [], _turn([6]), version=3)
    group, (ra, rb) = book.finish(b.id, 0.0, version=4)
    assert group.prompt_ids == [1, 2]  # what both first prompts share
    assert ra.token_ids.tolist() == [3, 9, 9, 5, 8] and ra.loss_mask.tolist() == [0, 1, 1, 0, 1]
    assert ra.versions.tolist() == [3, 3, 3, 3, 4] and ra.env_rewards.tolist() == [0.0, 1.0]
    assert rb.token_ids.tolist() == [4, 6] and rb.env_rewards.tolist() == [0.0]
    assert (book.groups, book.sessions) == (0, 0)

    book.hand_out(PromptGroup(group_id=8, prompt_ids=[1], n=2), 0.0, {"n": 8}, "p")
    [held] = book.hand_out_first([({"n": 0}, "ref", "p")], temperature=0.5)
    assert book.take() is held and held.temperature == 0.5
    taken = book.take()
    clock[0] = 105.0
    book.episode(taken.id)  # a request keeps it alive
    clock[0] = 109.0
    assert book.idle() == ([], [held])  # the held-out one idled since 103 s; 8's since 105 s
    assert held.result.failure_kind == ABANDONED
    clock[0] = 110.5
    [(group_id, why)], ended = book.idle()
    assert (group_id, ended, book.groups, book.queue) == (8, [], 0, type(book.queue)())
    assert "no request for 5 s" in why
    with pytest.raises(Refused):
        book.episode(taken.id)


def test_answers_are_what_vllm_would_send_and_the_openai_package_reads_them():
    """The endpoint's answers are written by vLLM's response models: the `openai` package reads each back
    (whole and streamed, chat with a tool call, completions), token ids where asked."""
    import json

    import openai.types as ot
    import openai.types.chat as oc

    from rlflow.services.rollout.openai_api import DONE, ChatAnswer, CompletionAnswer, event, whole

    out = _turn([5, 6, 7])
    chat = ChatAnswer("policy", [1, 2], True, True, lambda ids: "".join(chr(96 + i) for i in ids))
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}
    read = oc.ChatCompletion.model_validate_json(whole(chat.whole(out, None, [call], "tool_calls")).body)
    choice = read.choices[0]
    assert choice.message.tool_calls[0].function.name == "add" and choice.finish_reason == "tool_calls"
    assert [c.token for c in choice.logprobs.content] == ["e", "f", "g"]
    assert choice.model_extra["token_ids"] == [5, 6, 7]
    assert read.usage.total_tokens == 5 and read.model_extra["prompt_token_ids"] == [1, 2]

    events = [event(e) for e in chat.events(out, "efg", [], "stop", usage_too=True)]
    chunks = [oc.ChatCompletionChunk.model_validate(json.loads(e[len(b"data: "):])) for e in events]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].model_extra["prompt_token_ids"] == [1, 2]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "efg"
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 3
    assert b'"finish_reason":null' in events[1] and b"prompt_token_ids" not in events[1]  # set fields only

    done = CompletionAnswer("policy", [1, 2], 0, False, lambda ids: "x" * len(ids), fingerprint="fp")
    text = ot.Completion.model_validate_json(whole(done.whole(out, "xxx")).body)
    assert (text.choices[0].text, text.system_fingerprint, text.choices[0].logprobs.token_logprobs) == (
        "xxx", "fp", [-0.5] * 3)
    assert text.choices[0].logprobs.text_offset == [0, 1, 2] and text.choices[0].logprobs.top_logprobs[0] == {"x": -0.5}
    assert "token_ids" not in (text.choices[0].model_extra or {}) or text.choices[0].model_extra["token_ids"] is None
    [last] = done.end(out, "x", usage_too=False)
    assert ot.Completion.model_validate_json(event(last)[len(b"data: "):]).choices[0].finish_reason == "stop"
    assert DONE == b"data: [DONE]\n\n"
