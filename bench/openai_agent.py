"""Outside agents over the OpenAI-compatible endpoint against the native env
path, on the same simulated task and engine.

The task is bench/agent.py's: episodes of 1 to 8 turns (uniform), each turn
followed by a tool call that takes a lognormal time (median 0.5 s, sigma
1.25, cut at 30 s), observations of 16 characters, on a simulated rollout of
64 slots (a turn of 50 tokens takes ~1 s) and a simulated trainer, 8 steps of
staleness (72 groups of 8 episodes granted at once), rlflow
itself on a local Ray (controller, transport, services). Natively the env
role plays it (`rlflow.env.sim:SimEnv`); through the endpoint, agent programs
on the `openai` package (this file with ``--play``: no rlflow import) that
the rollout starts play the same episodes over HTTP: a completion a turn, the
tool's wait, the observation appended to the prompt, and the episode ended
with its reward.

* http_vs_native: episodes finished per second through the endpoint over
  the same natively (between two trainer steps, after the pipeline filled);
* token_exact: the share of the tokens of the samples the rollout sends on
  that are identical to what the engine generated over and sampled (each
  episode's last turn, as the engine returned it to its agent with
  ``return_token_ids``: its prompt tokens and its own), measured with the
  endpoint and an agent program in this process's event loop;
* sessions: agent sessions (episodes taken, not yet ended) held at once,
  at most, while measured, through the router's one address in the
  two-replica run below (one replica of 64 slots holds 128 groups at most,
  1,024 episodes: `rlflow.algo.staleness.groups_held`);
* slot_occupancy: the share of the engine's slot time in use meanwhile;
* frameworks: of the four frameworks of examples/framework_agents.py (the
  OpenAI Agents SDK, LangGraph, smolagents, Pydantic AI), those whose
  episodes were trained in 3 steps of examples/framework_agents.toml (real
  vLLM, the embedded default; leave it out with ``--no-frameworks``);
* router_vs_direct: with two rollout replicas and agent programs the bench
  starts itself (a fleet that is not rlflow's), episodes finished per second
  with every program on the router's one address (agents.json's ``url``) over
  the same with the programs spread over the replicas' own;
* hostile_lost: samples lost or trained twice (`rlflow audit`) in a run whose
  router and replica are meanwhile held by 1,000 idle connections and sent
  a wrong key on every route, bodies that are not JSON, HTTP that does not
  parse, 10 MB, and a byte a second.

Targets: http_vs_native >= 0.9, token_exact = 1.0, sessions >= 1024,
slot_occupancy >= 0.9, frameworks = 4, router_vs_direct >= 0.95,
hostile_lost = 0. Ends with

    RESULT openai_agent http_vs_native=H token_exact=E sessions=C slot_occupancy=O frameworks=F
        router_vs_direct=R hostile_lost=L

(one line).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve()

#: bench/agent.py's settings for both runs: 168 groups of 8 episodes granted at once (a step's 8, and 20
#: steps' more).
NATIVE = dict(mode="async", step_s=0.02, replicas=1, workers=2, concurrency=1344, max_staleness=20)
#: Agent programs, and sessions each: as many episodes as the run's credits let it play at once.
PROGRAMS, SESSIONS = 4, 336
FRAMEWORKS = ("openai-agents", "langgraph", "smolagents", "pydantic-ai")


def native_bench():
    """bench/agent.py (imported here: the agent program this file also is imports nothing of rlflow's;
    bench/ is on the import path of a script run from it)."""
    import agent

    return agent


def agents_config(command: list[str], copies: int, step_s: float = NATIVE["step_s"], replicas: int = 1):
    """bench/agent.py's run with its episodes played by outside agents instead of its env role (on
    `replicas` rollout replicas)."""
    import msgspec

    from rlflow import config as C

    config = native_bench().config_of(**{**NATIVE, "step_s": step_s})
    return msgspec.structs.replace(
        config, pools={name: pool for name, pool in config.pools.items() if name != "tools"},
        roles=msgspec.structs.replace(config.roles, env=None,
                                      rollout=msgspec.structs.replace(config.roles.rollout, replicas=replicas)),
        agents=C.AgentsConfig(command=command, copies=copies, max_turns=8, max_tokens=8192, idle_timeout_s=120.0))


# -- the agent program (``--play``): the openai package and the standard library ------------------------


def play(sessions: int, record: str) -> None:
    """Play episodes as SimEnv would have them played, `sessions` at once, until killed; with `record`,
    write each episode's last turn as the engine returned it (JSON lines)."""
    import asyncio
    import random

    import httpx
    import openai

    url, key = os.environ["RLFLOW_AGENTS_URL"], os.environ["OPENAI_API_KEY"]
    out = open(record, "a") if record else None  # noqa: SIM115 (open for the program's life)

    async def main() -> None:
        limits = httpx.Limits(max_connections=2 * sessions, max_keepalive_connections=2 * sessions)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600,
                                     limits=limits) as hand_out:
            llm = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600,
                                     http_client=openai.DefaultAsyncHttpxClient(limits=limits))

            async def session(seed: int) -> None:
                rng = random.Random(seed)
                while True:
                    try:
                        taken = await hand_out.post("/rlflow/episodes", json={"wait_s": 30})
                        if taken.status_code == 410:  # the run is over
                            return
                        if taken.status_code != 200:
                            continue
                        await episode_of(rng, taken.json())
                    except openai.APIStatusError as exc:  # its replica is gone, or its answer was cut: another
                        if exc.status_code not in (410, 502):
                            raise
                    except (openai.APIConnectionError, httpx.TransportError):  # a replica it spoke to went away
                        await asyncio.sleep(0.5)

            async def episode_of(rng: random.Random, episode: dict) -> None:
                model = llm.with_options(base_url=episode["base_url"])
                prompt, turns, spans = "p" * 32, rng.randint(1, 8), []
                for turn in range(1, turns + 1):
                    done = await model.completions.create(model="policy", prompt=prompt, max_tokens=512,
                                                          extra_body={"return_token_ids": bool(out)})
                    if out:  # where the engine's own tokens of this turn lie in the episode
                        extra = done.choices[0].model_extra
                        spans.append((len(extra["prompt_token_ids"]), len(extra["token_ids"])))
                    await asyncio.sleep(min(30.0, 0.5 * math.exp(1.25 * rng.gauss(0, 1))))  # the tool
                    prompt += done.choices[0].text + "o" * 16
                if out:
                    extra = done.choices[0].model_extra
                    out.write(json.dumps({"id": episode["id"], "tokens": extra["prompt_token_ids"] +
                                          extra["token_ids"], "own": spans}) + "\n")
                    out.flush()
                await hand_out.post(f"/rlflow/episodes/{episode['id']}/end",
                                    json={"reward": float(rng.random() < 0.5)})

            await asyncio.gather(*(session(seed) for seed in range(sessions)))

    asyncio.run(main())


# -- the bench --------------------------------------------------------------------------------------------


def sessions_window(window: float, slots: int = 64):
    """bench/agent.py's `Window` that also keeps the most agent sessions held at once while it measures."""
    native = native_bench()

    class Sessions(native.Window):
        most = 0

        def observe(self, status) -> bool:
            rollout = status.roles.get("rollout")
            if rollout is not None and self.start is not None:
                self.most = max(self.most, rollout.queues.get("agent_sessions", 0))
            return super().observe(status)

        def more(self) -> str:
            return f", {self.most} sessions at most"

    return Sessions(3, window, True, slots=slots)


def endpoint_run(work: pathlib.Path, window: float, copies: int, sessions: int):
    """The endpoint's window (bench/agent.py's `Window`), and the most sessions held meanwhile."""
    config = agents_config([sys.executable, str(HERE), "--play", "--sessions", str(sessions)], copies)
    return native_bench().measure(work, "endpoint", sessions_window(window), config)


def fleet_run(work: pathlib.Path, window: float, via: str, hostile: bool = False):
    """Two rollout replicas and `PROGRAMS` agent programs that the bench starts once agents.json names
    both (a fleet that is not rlflow's): `via` "router", every program on the router's address, or
    "direct", the programs spread over the replicas' own; with `hostile`, hostile clients at the router
    and a replica meanwhile. The window, and the run's directory."""
    import subprocess
    import threading

    import msgspec

    from rlflow.rundir import RunDir

    config = agents_config([], 1, replicas=2)
    if hostile:  # a slow client and a big body are refused within seconds
        config = msgspec.structs.replace(config, agents=msgspec.structs.replace(
            config.agents, read_timeout_s=5.0, max_body_bytes=1 << 20))
    name = f"fleet-{via}{'-hostile' if hostile else ''}"
    run_dir = work / name
    programs: list[subprocess.Popen] = []
    held: list = []

    def start_agents(status) -> None:
        if programs or (info := RunDir(run_dir).read_agents()) is None or len(info.urls) < 2:
            return
        spread = sorted(info.urls.values())
        for i in range(PROGRAMS):
            url = info.url if via == "router" else spread[i % len(spread)]
            programs.append(subprocess.Popen(
                [sys.executable, str(HERE), "--play", "--sessions", str(SESSIONS)],
                env={**os.environ, "RLFLOW_AGENTS_URL": url, "OPENAI_API_KEY": info.api_key}))
        if hostile:
            threading.Thread(target=hostile_clients, args=([info.url, spread[0]], info.api_key, held),
                             daemon=True).start()

    try:
        measured = native_bench().measure(work, name, sessions_window(window, slots=2 * 64), config, also=start_agents)
    finally:
        for program in programs:
            program.kill()
            program.wait()
        for sock in held:
            sock.close()
    return measured, run_dir


#: Every route of the endpoint, as a client that knows them would ask.
ROUTES = [("POST", "/rlflow/episodes"), ("POST", "/rlflow/episodes/1-0-00000000/end"),
          ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
          ("POST", "/episodes/1-0-00000000/v1/completions"), ("GET", "/v1/models")]


def hostile_clients(urls: list[str], key: str, held: list) -> None:
    """At each of `urls`: 500 connections opened and held idle (into `held`); a wrong key on every route,
    a body that is not JSON on every POST route, HTTP that does not parse, a 10 MB body, a body sent a
    byte a second. Prints the status each was answered with."""
    import collections
    import socket

    answers: dict[str, list[int]] = collections.defaultdict(list)

    def ask(address, head: bytes, body: bytes = b"", slowly: bool = False) -> int:
        with socket.create_connection(address, timeout=30) as sock:
            try:
                sock.sendall(head)
                if slowly:  # a byte a second, until answered
                    sock.settimeout(1.0)
                    for byte in body:
                        try:
                            return _status(sock.recv(4096))
                        except TimeoutError:
                            sock.sendall(bytes([byte]))
                else:
                    sock.sendall(body)
            except (BrokenPipeError, ConnectionResetError):  # answered (and closed) before it was all sent
                pass
            sock.settimeout(30)
            try:
                return _status(sock.recv(4096))
            except ConnectionResetError:
                return 0

    def request(method: str, path: str, body: bytes, auth: str) -> bytes:
        return (f"{method} {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {auth}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                ).encode()

    for url in urls:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        address = (host, int(port))
        held += [socket.create_connection(address) for _ in range(500)]
        for method, path in ROUTES:
            answers["wrong key"].append(ask(address, request(method, path, b"{}", "wrong") + b"{}"))
            if method == "POST":
                answers["not json"].append(ask(address, request(method, path, b"{not json", key) + b"{not json"))
        answers["not http"].append(ask(address, b"NOT HTTP AT ALL\r\n\r\n"))
        big = b"x" * (10 << 20)
        answers["10 MB"].append(ask(address, request("POST", "/v1/completions", big, key), big))
        answers["a byte a second"].append(ask(address, request("POST", "/v1/completions", b"{}" * 50, key),
                                              b"{}" * 50, slowly=True))
    print("hostile clients answered: " + ", ".join(f"{what} {sorted(set(codes))}" for what, codes in answers.items()),
          flush=True)


def _status(head: bytes) -> int:
    """The status of an HTTP answer's first bytes (0: the connection closed with none)."""
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def frameworks_run(work: pathlib.Path) -> int:
    """examples/framework_agents.toml for 3 steps (real vLLM, the embedded default, one framework a copy):
    the frameworks whose agents ended episodes of the groups trained."""
    from rlflow import config as C
    from rlflow.control.launch import run
    from rlflow.rundir import RunDir

    root = HERE.parent.parent
    record = work / "frameworks"
    record.mkdir()
    command = [sys.executable, str(root / "examples" / "framework_agents.py"), "--framework", "copy",
               "--sessions", "4", "--record", str(record)]
    config = C.load(root / "examples" / "framework_agents.toml", [
        f"agents.command={json.dumps(command)}", "run.steps=3", "eval.before=false", "eval.after=false"])
    native_bench()._wait_for_cpus()
    summary = run(config, work / "frameworks-run")
    if summary.state != "stopped":
        raise RuntimeError(f"frameworks: the run ended {summary.state}: {summary.error}")
    ledger = RunDir(work / "frameworks-run").ledger.read_text().splitlines()
    trained = {group for line in ledger if (event := json.loads(line))["event"] == "trained"
               for group in event["groups"]}
    played = []
    for framework in FRAMEWORKS:
        ended = [line.split()[0] for line in (record / f"{framework}.txt").read_text().splitlines()] \
            if (record / f"{framework}.txt").exists() else []
        if any(int(episode.split("-")[0]) in trained for episode in ended):
            played.append(framework)
    print(f"frameworks: {len(played)} of {len(FRAMEWORKS)} trained ({', '.join(played) or 'none'}; "
          f"{len(trained)} groups in {summary.steps} steps)", flush=True)
    return len(played)


def native_run(work: pathlib.Path, window: float):
    native = native_bench()
    return native.measure(work, "native", native.Window(3, window, True), **NATIVE)


def exactness(work: pathlib.Path, groups: int, sessions: int) -> tuple[float, int, int]:
    """(share of identical tokens, tokens compared, episodes) over `groups` groups of 8 episodes played
    through an endpoint in this process (the simulated engine) by one agent program that records what
    the engine returned."""
    import subprocess

    import numpy as np
    import trio

    from rlflow.env.render import EpisodeText
    from rlflow.protocol import PromptGroup
    from rlflow.services.base import standalone_context
    from rlflow.services.rollout.agents import AgentEndpoint
    from rlflow.services.rollout.sim import SimEngine

    config = agents_config([], 1, step_s=0.002)
    ctx = standalone_context(config, "rollout")
    record = work / "turns.jsonl"

    class Task:
        def row(self, group_id):
            return {}

        def decode(self, ids):
            return ""

    async def main() -> list:
        engine = SimEngine(config.roles.rollout.engine, ctx)
        endpoint = AgentEndpoint(engine, Task(), config.agents, text=EpisodeText(None), make_parser=None,
                                 turn_tokens=512, counters=ctx.counters, api_key="bench", rank=0, replicas=1,
                                 takes_reward=True, holds=groups)  # the bench grants every group at once
        url = endpoint.bind()
        finished = []
        env = {**os.environ, "RLFLOW_AGENTS_URL": url, "OPENAI_API_KEY": "bench"}
        agent = subprocess.Popen([sys.executable, str(HERE), "--play", "--sessions", str(sessions), "--record",
                                  str(record)], env=env)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                await nursery.start(endpoint.run)
                for g in range(groups):
                    endpoint.submit(PromptGroup(group_id=g, prompt_ids=[], n=8), time.time())
                with trio.fail_after(600):
                    while len(finished) < groups:
                        finished += await endpoint.finished.receive()
                nursery.cancel_scope.cancel()
        finally:
            agent.kill()
            agent.wait()
        return finished

    finished = trio.run(main)
    engine_saw = {}
    for line in record.read_text().splitlines():
        turn = json.loads(line)
        group_id, index, _ = turn["id"].split("-")
        engine_saw[(int(group_id), int(index))] = turn
    same = total = episodes = 0
    for group, responses in finished:
        for index, response in enumerate(responses):
            # The sample: its tokens, and which are the engine's own (trained on).
            tokens = list(group.prompt_ids) + response.token_ids.tolist()
            own = np.concatenate([np.zeros(len(group.prompt_ids), np.uint8), response.loss_mask])
            # What the engine generated over and sampled: the last turn's tokens, each turn's own.
            saw = engine_saw[(group.group_id, index)]
            expected = np.zeros(len(saw["tokens"]), np.uint8)
            for start, length in saw["own"]:
                expected[start:start + length] = 1
            total += max(len(tokens), len(saw["tokens"]))
            same += sum(a == b and m == e for a, b, m, e in zip(tokens, saw["tokens"], own, expected))
            episodes += 1
    return same / max(total, 1), total, episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--play", action="store_true", help="be the agent program (the rollout starts it so)")
    parser.add_argument("--sessions", type=int, default=80, help="with --play: episodes played at once")
    parser.add_argument("--record", default="", help="with --play: write each episode's last turn here")
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured per run (at least)")
    parser.add_argument("--quick", action="store_true", help="windows of 20 s (the edit loop)")
    parser.add_argument("--no-frameworks", action="store_true",
                        help="leave out the frameworks' run (real vLLM; its dependencies are the test extra's)")
    args = parser.parse_args()
    if args.play:
        return play(args.sessions, args.record)
    if args.quick:
        args.window = 20.0

    from rlflow import config as C
    from rlflow.control import placement

    work = pathlib.Path(tempfile.mkdtemp(prefix="rlflow-openai-agent-"))
    exact, tokens, episodes = exactness(work, groups=32, sessions=64)
    print(f"token exactness: {exact:.4f} of {tokens} tokens of {episodes} episodes", flush=True)
    from rlflow.tools.audit import audit

    placement.start_ray(C.ClusterConfig())
    try:
        endpoint = endpoint_run(work, args.window, copies=PROGRAMS, sessions=SESSIONS)
        native = native_run(work, args.window)
        direct, _ = fleet_run(work, args.window, "direct")
        routed, _ = fleet_run(work, args.window, "router")
        _, hostile_dir = fleet_run(work, min(args.window, 20.0), "router", hostile=True)
        frameworks = -1 if args.no_frameworks else frameworks_run(work)
    finally:
        placement.stop_ray()
    hostile = audit(hostile_dir)
    print(f"hostile run: {hostile.trained} groups trained, lost {hostile.lost}, duplicated {hostile.duplicated}")
    result = {
        "http_vs_native": endpoint.episodes_per_s / native.episodes_per_s,
        "token_exact": exact,
        "sessions": routed.most,
        "slot_occupancy": endpoint.occupancy,
        "frameworks": frameworks,
        "router_vs_direct": routed.episodes_per_s / direct.episodes_per_s,
        "hostile_lost": hostile.lost + hostile.duplicated,
    }
    (work / "result.json").write_text(json.dumps(result, indent=1))
    print(f"results in {work}")
    print(f"RESULT openai_agent http_vs_native={result['http_vs_native']:.2f} token_exact={exact:.4f} "
          f"sessions={result['sessions']} slot_occupancy={result['slot_occupancy']:.2f} frameworks={frameworks} "
          f"router_vs_direct={result['router_vs_direct']:.2f} hostile_lost={result['hostile_lost']}")


if __name__ == "__main__":
    sys.exit(main())
