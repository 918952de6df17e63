"""Multi-turn episodes: the env pool and what the env role answers, episodes
played by the simulated engine (token-exact trajectories and masks, cut-offs,
failures, a weight update mid-episode), the reward and trainer's use of
them, and whole runs with an env role (one replica killed mid-run)."""

from __future__ import annotations

import json
import math
from collections import Counter

import msgspec
import numpy as np
import pytest
import trio
import trio.testing

from rlflow import config as C
from rlflow.env import EnvironmentSpec, EnvHandler, ToolSpec, open_env_pool
from rlflow.env.render import ByteTokenizer, EpisodeText
from rlflow.protocol import EnvReset, EnvStep, FinishReason, PromptGroup, SampleBatch, ToolCall
from rlflow.services.base import standalone_context
from rlflow.services.rollout.envclient import InlineEnv
from rlflow.services.rollout.episodes import EpisodeRunner
from rlflow.services.rollout.source import episode_metrics
from rlflow.services.rollout.sim import SimEngine
from rlflow.tools.check import CheckError

COUNT = EnvironmentSpec(path="envs:Count", kwargs={"turns": 3})
TOOLS = [ToolSpec(path="envs:add"), ToolSpec(path="envs:stall", timeout_s=0.5), ToolSpec(path="envs:nap"),
         ToolSpec(path="envs:die"), ToolSpec(path="envs:pid")]


# -- the pool and the handler ----------------------------------------------------------------------


@pytest.mark.slow  # worker processes killed and started again
async def test_the_pool_runs_each_call_and_says_how_it_ended():
    async with open_env_pool(COUNT, TOOLS, workers=2, concurrency=4) as pool:
        assert [json.loads(t)["function"]["name"] for t in pool.tools] == ["add", "stall", "nap", "die", "pid"]
        assert json.loads(pool.tools[0])["function"]["parameters"]["required"] == ["a", "b"]
        reset = await pool.call("reset", {"row": {"start": 4}}, 5)
        assert reset.ok and reset.value == {"text": "count:4", "messages": []}
        episode = {"row": {}, "turn": 1, "turns": ["x"], "state": {"seen": 4}}
        step = await pool.call("step", {"episode": episode, "turn": "x"}, 5)
        assert step.value == {"text": "<1:5>", "messages": [], "reward": 0.1, "done": False, "state": {"seen": 5}}
        assert (await pool.call("tool", {"name": "add", "arguments": {"a": 2, "b": 3}}, 5)).value == "5"
        # Async code overruns: cancelled in the worker, which goes on.
        before = (await pool.call("tool", {"name": "pid", "arguments": {}}, 5)).value
        slow = await pool.call("tool", {"name": "nap", "arguments": {"seconds": 5}}, 0.2)
        assert slow.status == "timeout" and pool.restarts == 0
        # Sync code overruns: the worker is killed and replaced.
        stalled = await pool.call("tool", {"name": "stall", "arguments": {"seconds": 30}}, 0.3)
        assert stalled.status == "timeout" and "killed" in stalled.message
        crashed = await pool.call("tool", {"name": "die", "arguments": {}}, 5)
        assert crashed.status == "crashed" and "exited with code 3" in crashed.message
        raised = await pool.call("tool", {"name": "add", "arguments": {"a": 1}}, 5)
        assert raised.status == "error" and "TypeError" in raised.message
        with trio.fail_after(30):
            while pool.restarts < 2 or len(pool._workers) < 2:
                await trio.sleep(0.05)
        pids = {(await pool.call("tool", {"name": "pid", "arguments": {}}, 5)).value for _ in range(6)}
        assert len(pids) <= 2 and (before not in pids or pool.restarts >= 2)


async def test_the_guessing_environment_of_the_readme_plays():
    import pathlib

    examples = str(pathlib.Path(__file__).resolve().parent.parent / "examples")
    async with open_env_pool(EnvironmentSpec(path="guess:Guess"), workers=1, import_dir=examples) as pool:
        episode = {"row": {"secret": 42}, "turn": 1}
        answers = [(await pool.call("step", {"episode": episode, "turn": said}, 5)).value
                   for said in ("50", "x", " 42")]
    assert [(a["text"], a["reward"], a["done"]) for a in answers] == [
        ("Lower. ", 0.0, False), ("Say a number. ", 0.0, False), ("", 1.0, True)]


async def test_async_calls_overlap_in_one_worker():
    async with open_env_pool(EnvironmentSpec(path="envs:Slow", kwargs={"wait_s": 0.5}), workers=1,
                             concurrency=8) as pool:
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(pool.call, "step", {"episode": {"row": {}}, "turn": "x"}, 5)
        assert trio.current_time() - started < 2.5  # eight waits of 0.5 s, side by side


async def test_a_worker_that_cannot_load_the_environment_stops_the_pool_naming_it():
    from rlflow.rewards import PoolError

    with pytest.raises(PoolError, match="envs.*no attribute 'Nope'"):
        async with open_env_pool(EnvironmentSpec(path="envs:Nope"), workers=1):
            pass


@pytest.mark.slow  # a run of episodes
async def test_tool_calls_that_fail_become_observations_counted_by_kind():
    counters: Counter[str] = Counter()
    # Two workers of one call each: the call that stalls its worker takes no other down with it.
    async with open_env_pool(COUNT, TOOLS, workers=2, concurrency=1) as pool:
        handler = EnvHandler(pool, tools=TOOLS, timeout_s=5, counters=counters)

        def step(calls=(), unparsed=""):
            return EnvStep(request_id=1, group_id=0, index=0, turn=1, text="t", calls=list(calls), unparsed=unparsed,
                           state={"seen": 1})

        ok = await handler.answer(step([ToolCall(name="add", arguments='{"a": 1, "b": 2}', id="c0"),
                                        ToolCall(name="stall", arguments='{"seconds": 10}', id="c1")]))
        assert [m.content for m in ok.messages][0] == "3" and ok.messages[0].tool_call_id == "c0"
        assert ok.messages[1].content.startswith("Error: stall timed out")
        assert [(r.name, r.status) for r in ok.results] == [("add", "ok"), ("stall", "timeout")]
        assert not ok.done and ok.reward == 0.0 and ok.state == {"seen": 1}
        unknown = await handler.answer(step([ToolCall(name="rm", arguments="{}")]))
        assert "no tool 'rm'" in unknown.messages[0].content and unknown.results[0].status == "unknown"
        bad = await handler.answer(step([ToolCall(name="add", arguments="[1, 2]")]))
        assert "not a JSON object" in bad.messages[0].content
        unparsed = await handler.answer(step(unparsed="no well-formed tool call"))
        assert "could not be parsed" in unparsed.messages[0].content and unparsed.results[0].status == "unparsed"
        answered = await handler.answer(step())  # no tool calls: the environment's step
        assert answered.text == "<1:2>" and answered.reward == pytest.approx(0.1)
    assert counters == {"env_requests": 5, "env.tool.add.ok": 1, "env.tool.stall.timeout": 1, "env.tool.unknown": 1,
                        "env.tool.add.error": 1, "env.tool.unparsed": 1, "env.step.ok": 1}


async def test_an_environment_that_fails_fails_the_request_in_band():
    counters: Counter[str] = Counter()
    async with open_env_pool(EnvironmentSpec(path="envs:BadReturn"), workers=1) as pool:
        handler = EnvHandler(pool, tools=[], timeout_s=5, counters=counters)
        reply = await handler.answer(EnvStep(request_id=3, group_id=0, index=0, turn=1, text="t"))
        assert reply.request_id == 3 and reply.error_kind == "error" and "expected (observation, reward, done)" \
            in reply.error
        reset = await handler.answer(EnvReset(request_id=4, group_id=0, scripted=True))
        assert reset.text == "go" and reset.scripted == []


# -- episodes on the simulated engine ----------------------------------------------------------------


def sim_config(*overrides: str) -> C.Config:
    return C.load(text="""
[pools.p]
[roles.rollout]
pool = "p"
[roles.rollout.engine]
kind = "sim"
slots = 4
step_s = 0.002
response_len = { kind = "lognormal", median = 8, sigma = 0.5, min = 1, max = 32 }
[roles.reward]
pool = "p"
[roles.trainer]
pool = "p"
[roles.env]
pool = "p"
environment = { path = "envs:Count", kwargs = { turns = 3 } }
""", overrides=list(overrides))


def test_check_plays_the_environments_scripted_turns_as_the_model_will_see_them():
    from rlflow.tools.check import check

    lines: list[str] = []
    figures = check(sim_config(), say=lines.append)
    assert figures["episodes"] == 2 and figures["episode_reward_mean"] == pytest.approx(0.1 + 0.2 + 0.3)
    shown = "\n".join(lines)
    assert "[model turn 2] two\n[reward 0.2]\n<2:2>" in shown and "[reward 0.3, done]" in shown
    with pytest.raises(CheckError, match="environment: the step of turn 2 of group 0 failed: .*the environment broke"):
        check(sim_config('roles.env.environment={path="envs:ScriptedFailing"}'), say=lines.append)


def test_env_configs_that_cannot_run_get_one_clear_line():
    with pytest.raises(C.ConfigError, match=r"roles.env.tools.*two tools are named 'add'"):
        sim_config('roles.env.tools=[{path="envs:add"}, {path="other:add"}]')
    with pytest.raises(C.ConfigError, match=r"roles.env.inline.*simulated rollout"):
        sim_config("roles.env.inline=true", 'roles.env.pool=""', 'roles.rollout.engine={kind="vllm"}')
    with pytest.raises(C.ConfigError, match=r"roles.reward.inline.*scored by the reward role"):
        sim_config("roles.reward.inline=true")
    with pytest.raises(C.ConfigError, match=r"environment path 'nope' must look like 'package.module:Class'"):
        sim_config('roles.env.environment.path="nope"')
    assert [name for name, _ in sim_config().role_items()] == ["rollout", "env", "reward", "trainer"]
    inline = sim_config("roles.env.inline=true", 'roles.env.pool=""')
    assert [name for name, _ in inline.role_items()] == ["rollout", "reward", "trainer"]


class Recording:
    """The engine, with every turn it generated and the sequence it was given."""

    def __init__(self, engine: SimEngine):
        self.engine = engine
        self.turns: list[tuple[list[int], object]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, prompt_ids, **kwargs):
        response = await self.engine.generate(prompt_ids, **kwargs)
        self.turns.append((list(prompt_ids), response))
        return response


async def play(config: C.Config, *, n: int = 2, during=None, environment: EnvironmentSpec = COUNT, tools=()):
    """Play one group of `n` episodes on a simulated engine with an env pool of this process;
    (the group, its responses, the recording engine, the rollout's counters)."""
    ctx = standalone_context(config, "rollout")
    engine = SimEngine(config.roles.rollout.engine, ctx)
    env_cfg = msgspec.structs.replace(config.roles.env, environment=environment, tools=list(tools))
    async with open_env_pool(environment, tools, workers=1, concurrency=8) as pool, trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        recording = Recording(engine)
        handler = EnvHandler(pool, tools=list(tools), timeout_s=5, counters=ctx.counters)
        runner = EpisodeRunner(recording, InlineEnv(handler, engine.hold), _Rows(), env_cfg, turn_tokens=64,
                               text=EpisodeText(None), counters=ctx.counters, holds=1)
        if during is not None:
            nursery.start_soon(during, engine)
        with trio.fail_after(60):
            group, responses = await runner.play(PromptGroup(group_id=7, prompt_ids=[], n=n), 0.0)
        nursery.cancel_scope.cancel()
    return group, responses, recording, ctx.counters


class _Rows:
    def row(self, group_id: int) -> dict:
        return {"start": group_id}


def observation(turn: int, seen: int) -> list[int]:
    return ByteTokenizer.encode(f"<{turn}:{seen}>")


async def test_an_episode_is_one_token_sequence_with_the_model_tokens_as_generated_and_observations_masked():
    group, responses, recording, counters = await play(sim_config())
    assert list(group.prompt_ids) == ByteTokenizer.encode("count:7")
    assert len(responses) == 2 and len(recording.turns) == 6
    for index, response in enumerate(responses):
        assert response.finish_reason == FinishReason.STOP and response.error is None
        ids, mask = response.token_ids.tolist(), response.loss_mask.tolist()
        # Rebuild the sequence from the turns the engine generated, in the order it was given them.
        expected_ids, expected_mask, expected_lp, expected_ver = [], [], [], []
        start = len(group.prompt_ids)
        mine = [(prompt, out) for prompt, out in recording.turns  # this episode's turns, in order
                if ids[:len(prompt) - start + len(out.token_ids)] == prompt[start:] + out.token_ids.tolist()]
        assert len(mine) == 3
        for turn, (prompt, out) in enumerate(mine, start=1):
            # The engine saw the whole episode so far, every token as it was.
            assert prompt == list(group.prompt_ids) + expected_ids
            expected_ids += out.token_ids.tolist()
            expected_mask += [1] * len(out.token_ids)
            expected_lp += out.logprobs.tolist()
            expected_ver += out.versions.tolist()
            if turn < 3:
                seen = observation(turn, turn)  # the state travelled: seen counts this episode's steps
                expected_ids += seen
                expected_mask += [0] * len(seen)
                expected_lp += [0.0] * len(seen)
                expected_ver += [expected_ver[-1]] * len(seen)
        assert ids == expected_ids and mask == expected_mask
        assert response.logprobs.tolist() == pytest.approx(expected_lp)
        assert response.versions.tolist() == expected_ver
        assert response.env_rewards.tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert counters["episodes"] == 2 and counters["episode_turns"] == 6
    assert counters["env.step.ok"] == 6 and counters["env.reset.ok"] == 1


async def test_episodes_are_cut_off_at_their_turns_and_tokens():
    _, by_turns, _, _ = await play(sim_config("roles.env.max_turns=2"))
    assert [r.finish_reason for r in by_turns] == [FinishReason.TURNS] * 2
    assert [len(r.env_rewards) for r in by_turns] == [2, 2]
    # Three turns of at least 8 tokens (the length draws' minimum here is 1, so fix them) and two observations.
    config = sim_config("roles.env.max_tokens=20", 'roles.rollout.engine.response_len={kind="fixed", value=8}')
    _, by_tokens, _, _ = await play(config)
    for r in by_tokens:
        assert r.finish_reason == FinishReason.LENGTH and len(r.token_ids) <= 20
        assert r.loss_mask.tolist() == [1] * 8 + [0] * 5 + [1] * 7  # the second turn got what was left


async def test_an_environment_that_fails_mid_episode_fails_that_sample():
    _, responses, _, _ = await play(sim_config(), environment=EnvironmentSpec(path="envs:Failing"))
    for r in responses:
        assert r.finish_reason == FinishReason.ERROR and r.failure_kind == "env_error"
        assert "the environment broke" in r.error


async def test_a_weight_update_mid_episode_applies_between_steps_and_runs_no_turn_again():
    """Weights arrive while the episodes wait for their environment: their
    later turns carry the new version, the earlier ones keep theirs, and
    the environment was asked once per turn."""

    async def update(engine: SimEngine) -> None:
        while engine.ctx.counters["env.step.ok"] < 2:
            await trio.sleep(0.005)
        # What `update_weights` does once the payload has arrived.
        engine.batcher.incoming = 1
        engine._wake.set()

    config = sim_config("roles.env.environment.kwargs.turns=4")
    _, responses, recording, counters = await play(config, during=update, environment=msgspec.structs.replace(
        COUNT, kwargs={"turns": 4}))
    for r in responses:
        own = r.versions[r.loss_mask == 1]
        assert own[0] == 0 and own[-1] == 1 and list(own) == sorted(own)
    assert counters["env.step.ok"] == 8 and len(recording.turns) == 8  # 2 episodes x 4 turns, each once


async def test_every_turn_waiting_for_a_version_goes_on_once_the_engine_holds_it():
    """Many episodes' turns wait at the vLLM engine's barrier at once (their groups' `min_version`
    is ahead of the weights held): each goes on at the first change that reaches its version, none
    earlier, none left behind."""
    from rlflow.services.rollout.engine import VersionWait

    held, barrier, started = [0], VersionWait(), []

    async def turn(i: int, version: int) -> None:
        await barrier.reach(version, lambda: held[0])
        started.append((i, held[0]))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(turn, i, 1 + i % 3)
            await trio.testing.wait_all_tasks_blocked()
            for version in (1, 2, 3):
                held[0] = version
                barrier.changed()
                await trio.testing.wait_all_tasks_blocked()
                assert sorted(i for i, at in started if at == version) == [i for i in range(12) if 1 + i % 3 == version]
    assert len(started) == 12


def test_held_out_metrics_count_a_positive_reward_by_each_turn():
    from rlflow.protocol import Response

    def played(rewards):
        return Response(np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32), 0,
                        env_rewards=np.asarray(rewards, np.float32))

    metrics = episode_metrics([played([1.0]), played([0.0, 0.5]), played([0.0, 0.0]), played([0.0])], 2)
    assert metrics["accuracy.turn1"] == 0.25 and metrics["accuracy.turn2"] == 0.5 == metrics["accuracy"]
    assert metrics["turns_mean"] == 1.5 and metrics["reward_mean"] == pytest.approx(0.375)


# -- chat templates and tool calls ------------------------------------------------------------------------


def chat_tokenizer():
    """A character tokenizer with Qwen's chat markers as special tokens and a template in their style."""
    from rlflow.models import build_tokenizer

    tokenizer = build_tokenizer("".join(chr(c) for c in range(32, 127)) + "\n")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<tool_call>",
                                                                "</tool_call>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = (
        "{% if tools %}<|im_start|>system\nTools: {{ tools | map('tojson') | join(' ') }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


def test_observations_are_rendered_once_after_the_model_turn_with_the_template_glue():
    from rlflow.protocol import ChatMessage, EnvReply

    tokenizer = chat_tokenizer()
    text = EpisodeText(tokenizer)
    tools = [json.dumps({"type": "function", "function": {"name": "add"}})]
    prompt = text.first(EnvReply(request_id=0, messages=[ChatMessage(role="user", content="hi")], tools=tools))
    assert tokenizer.decode(prompt, skip_special_tokens=False).startswith("<|im_start|>system\nTools: {")
    assert tokenizer.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>user\nhi<|im_end|>\n"
                                                                        "<|im_start|>assistant\n")
    # The model's turn ends with its end-of-turn token; the observation starts with what the template
    # writes after it, and ends with the next generation prompt.
    seen = text.observation(EnvReply(request_id=1, messages=[ChatMessage(role="tool", content="5")]), tools)
    assert tokenizer.decode(seen, skip_special_tokens=False) == "\n<|im_start|>tool\n5<|im_end|>\n" \
                                                                "<|im_start|>assistant\n"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn = tokenizer.encode("sure", add_special_tokens=False) + [end]
    whole = list(prompt) + turn + list(seen)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "sure"},
                    {"role": "tool", "content": "5"}]
    assert whole == tokenizer.apply_chat_template(conversation, tools=[json.loads(t) for t in tools],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False)


def test_a_turn_stops_before_its_first_stop_string_at_a_token_boundary():
    tokenizer = chat_tokenizer()
    text = EpisodeText(tokenizer)
    ids = tokenizer.encode("think\nAction: add\nObservation: 5", add_special_tokens=False)
    keep = text.before_stop(ids, ["Observation:", "\nAct"])
    # The first stop string in the text wins, whichever is listed first; what is kept reads as the text before it.
    assert text.decode(ids[:keep]) == "think"
    assert text.decode(ids[:text.before_stop(ids, ["Observation:"])]) == "think\nAction: add\n"
    assert text.before_stop(ids, ["nowhere", ""]) is None and text.before_stop(ids, []) is None
    assert text.before_stop(ids, ["think"]) == 0
    # A token that runs into the stop string goes with it: what is kept never holds part of it.
    tokenizer.add_tokens(["ab"])
    joined = tokenizer.encode("xabc", add_special_tokens=False)
    assert len(joined) == 3 and text.decode(joined[1:2]) == "ab"
    assert text.before_stop(joined, ["bc"]) == 1


@pytest.mark.slow  # imports vLLM (tens of seconds here)
async def test_tool_calls_are_read_by_vllms_parser_and_a_broken_one_is_said_unparsed():
    """The parser is made once, off the loop's thread (vLLM's parsers are a heavy import)."""
    import threading

    from rlflow.services import compat

    tokenizer = chat_tokenizer()
    made_in = []

    def make(tools):
        made_in.append(threading.current_thread())
        return compat.tool_parser("hermes", tokenizer, tools)

    text = EpisodeText(tokenizer, make, "hermes")
    turn = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    calls, unparsed = await text.calls(tokenizer.encode(turn, add_special_tokens=False), [])
    assert unparsed == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 2</tool_call><|im_end|>'
    calls, unparsed = await text.calls(tokenizer.encode(broken, add_special_tokens=False), [])
    assert calls == [] and "no well-formed tool call" in unparsed
    assert await text.calls(tokenizer.encode("just text<|im_end|>", add_special_tokens=False), []) == ([], "")
    assert len(made_in) == 1 and made_in[0] is not threading.main_thread()


# -- what the reward and the trainer make of episodes ------------------------------------------------------


async def test_the_reward_adds_the_environments_and_functions_see_every_turn():
    from rlflow.protocol import Response, build_batch, samples
    from rlflow.services.reward.scorer import Scorer, sample_of

    class Task:
        def score(self, group, index, response_ids):
            return 0.25, {"correct": 0.25}

        def decode(self, ids):
            return ByteTokenizer.decode(list(ids))

        def row(self, group_id):
            return {"q": 1}

    tok = ByteTokenizer.encode
    ids = tok("ab") + tok("<obs>") + tok("cd")
    responses = [
        Response(np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int32), 0,
                 loss_mask=np.asarray([1, 1, 0, 0, 0, 0, 0, 1, 1], np.uint8),
                 env_rewards=np.asarray([0.0, 1.0], np.float32)),
        Response(np.asarray(tok("x"), np.int32), np.zeros(1, np.float32), np.zeros(1, np.int32), 0,
                 loss_mask=np.ones(1, np.uint8), env_rewards=np.asarray([0.5], np.float32)),
    ]
    batch = build_batch([(PromptGroup(group_id=3, prompt_ids=tok("q?"), n=2), responses)])
    scorer = Scorer(C.SimReward(), Task(), Counter(), (0,), env_weight=2.0)
    scored, failures = await scorer.score(batch)
    assert failures == [] and scored.rewards.numpy().tolist() == pytest.approx([2.25, 1.25])
    details = {k: v.numpy().tolist() for k, v in scored.reward_details.items()}
    assert details["env"] == pytest.approx([1.0, 0.5]) and details["env.turn1"] == pytest.approx([0.0, 0.5])
    assert math.isnan(details["env.turn2"][1])
    sample = sample_of(Task(), next(samples(batch)))
    assert sample.prompt == "q?" and sample.turns == ("ab", "cd") and sample.observations == ("<obs>",)
    assert sample.response == "ab<obs>cd"
    env_only = Scorer(C.EnvReward(), Task(), Counter(), (0,), env_weight=1.0)
    assert (await env_only.score(batch))[0].rewards.numpy().tolist() == pytest.approx([1.0, 0.5])


@pytest.mark.slow  # trains a model twice
def test_the_trainer_trains_on_the_model_tokens_alone(tmp_path):
    """The loss mask: whatever an episode's observation tokens carry in the
    columns the loss reads (their behaviour log-probabilities), a step moves
    the weights the same and counts only the model's tokens; without the
    mask the same batch moves them otherwise."""
    import torch
    from models import tiny_model

    from rlflow.protocol import Response, Tensor, build_batch
    from rlflow.services.trainer.torch_engine import TorchEngine

    path = tiny_model(tmp_path / "model", tied=False, seed=3)

    def batch(observed_logprob: float, masked: bool = True) -> SampleBatch:
        rng = np.random.default_rng(0)
        groups, rewards = [], []
        for g in range(2):
            responses = []
            for i in range(4):
                ids = np.asarray(rng.integers(3, 17, 4).tolist() + [5, 6, 7] + rng.integers(3, 17, 3).tolist(),
                                 np.int32)
                mask = np.asarray([1] * 4 + [0] * 3 + [1] * 3, np.uint8)
                logprobs = np.where(mask == 1, -2.0, observed_logprob).astype(np.float32)
                responses.append(Response(ids, logprobs, np.zeros(len(ids), np.int32), FinishReason.STOP,
                                          loss_mask=mask if masked else None))
                rewards.append(float(i % 2))
            groups.append((PromptGroup(group_id=g, prompt_ids=[3, 4, 5], n=4), responses))
        return msgspec.structs.replace(build_batch(groups), rewards=Tensor.of(rewards, "float32"))

    cfg = C.TorchTrainer(lr=1e-2, micro_batch_tokens=32)
    after = []
    for observed_logprob, masked in ((0.0, True), (-7.0, True), (-2.0, False)):
        engine = TorchEngine(cfg, str(path), seed=0)
        stats = engine.train(batch(observed_logprob, masked))
        assert stats["trained_tokens"] == 8 * (7 if masked else 10)
        after.append([p.detach().clone() for p in engine.model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(after[0], after[1]))
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(after[0], after[2]))


@pytest.mark.slow  # builds a model
def test_a_kl_penalty_in_the_reward_counts_the_model_tokens_alone(tmp_path):
    """kl_in = "reward": an episode's observation tokens are not the policy's, so what the
    reference (the teacher here) says of them changes neither the penalty nor the KL reported."""
    from models import tiny_model

    from rlflow.protocol import Response, Tensor, build_batch
    from rlflow.services.trainer.torch_engine import TorchEngine

    path = tiny_model(tmp_path / "model", tied=False, seed=3)
    mask = np.asarray([1] * 4 + [0] * 3 + [1] * 3, np.uint8)

    def batch(observed_teacher: float, masked: bool = True) -> SampleBatch:
        rng = np.random.default_rng(0)
        groups = []
        for g in range(2):
            responses = [Response(np.asarray(rng.integers(3, 17, 10), np.int32), np.full(10, -2.0, np.float32),
                                  np.zeros(10, np.int32), FinishReason.STOP, loss_mask=mask if masked else None)
                         for _ in range(4)]
            groups.append((PromptGroup(group_id=g, prompt_ids=[3, 4, 5], n=4), responses))
        teacher = np.tile(np.where(mask == 1, -2.5, observed_teacher), 8).astype(np.float32)
        return msgspec.structs.replace(build_batch(groups),
                                       rewards=Tensor.of([float(i % 2) for i in range(8)], "float32"),
                                       teacher_logprobs=Tensor.of(teacher.tolist(), "float32"))

    cfg = C.TorchTrainer(lr=1e-2, micro_batch_tokens=32, kl_coef=0.5, kl_in="reward")
    stats = [TorchEngine(cfg, str(path), seed=0).train(batch(t, m)) for t, m in ((-0.1, True), (-9.0, True),
                                                                                 (-9.0, False))]
    assert stats[0]["kl_penalty_mean"] > 0
    assert stats[0]["kl_penalty_mean"] == pytest.approx(stats[1]["kl_penalty_mean"])
    assert stats[0]["kl_teacher"] == pytest.approx(0.5)  # -2 - (-2.5), at the model's tokens
    assert stats[2]["kl_penalty_mean"] > 2 * stats[1]["kl_penalty_mean"]


# -- whole runs --------------------------------------------------------------------------------------------


def env_run(*overrides: str) -> C.Config:
    from test_controller import sim

    return sim("run.steps=6", 'roles.env.environment.path="rlflow.env.sim:SimEnv"', 'roles.env.pool="score"',
               "roles.env.environment.kwargs={min_turns=1, max_turns=4, latency={kind=\"lognormal\", "
               "median=0.01, sigma=1.0, max=0.2}}",
               "roles.env.workers=1", "roles.env.concurrency=32", "roles.rollout.engine.response_len.median=8",
               "cluster.heartbeat_timeout_s=5", *overrides)


async def test_a_run_with_an_env_role_trains_on_episodes(tmp_path):
    from test_controller import run_in_process

    from rlflow.rundir import RunDir

    with trio.fail_after(120):
        controller, summary = await run_in_process(env_run(), tmp_path)
    assert summary.state == "stopped", summary.error
    rows = RunDir(tmp_path).read_metrics()
    assert [r.step for r in rows] == list(range(6)) and all(r.samples == 16 for r in rows)
    assert all(1 <= r.train["episode_turns_mean"] <= 4 for r in rows)
    status = RunDir(tmp_path).read_status()
    env, rollout = status.roles["env"].counters, status.roles["rollout"].counters
    # (each episode has a step at least; the two counts are as of each role's last heartbeat)
    assert env.env_calls["reset.ok"] >= 24 and env.env_calls["step.ok"] >= rollout.episodes
    assert rollout.episode_turns >= rollout.episodes > 0  # (heartbeats: as of the last before the end)


@pytest.mark.slow  # a run with a kill and a restart
async def test_an_env_replica_killed_mid_run_is_replaced_and_its_episodes_granted_again(tmp_path):
    from test_controller import InProcessLauncher, run_in_process

    from rlflow.control.controller import Controller
    from rlflow.rundir import RunDir
    from rlflow.tools.audit import audit

    async def kill_env(controller: Controller, launcher: InProcessLauncher) -> None:
        while controller.ledger.steps_done < 2 or not all(r.live for r in controller.roster):
            await trio.sleep(0.02)
        await launcher.crash("env", 0)

    config = env_run("run.steps=8", "roles.env.replicas=1")
    with trio.fail_after(120):
        controller, summary = await run_in_process(config, tmp_path, during=kill_env)
    assert summary.state == "stopped", summary.error
    status = RunDir(tmp_path).read_status()
    assert status.roles["env"].restarts == 1 and status.roles["rollout"].restarts == 0
    assert summary.groups.reissued > 0
    result = audit(tmp_path)
    assert (result.lost, result.duplicated) == (0, 0), result
    assert result.trained == 8 * 4 and result.issued == result.trained + result.dropped
