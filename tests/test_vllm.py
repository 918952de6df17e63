"""Real vLLM on CPU: weight updates over gloo, log-probabilities, versions.

One vLLM engine (a tiny Qwen2 with a tied LM head: the case where vLLM-CPU
keeps a stale packed copy of the head after a reload) serves the session;
the test process plays the trainer, broadcasting over the same gloo group
the trainer service uses.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time

import numpy as np
import psutil
import pytest
import torch
import trio
from models import tiny_model

from rlflow.config import VllmRollout
from rlflow.data.net import free_port
from rlflow.services.weights import GlooGroup, layout, pack, pieces
from rlflow.tasks.core import load_tokenizer

pytestmark = pytest.mark.vllm

PROMPT = "12+34="


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tied") / "model", tied=True, seed=1)


@pytest.fixture(scope="session")
def engine(tied_model):
    """(vLLM backend, the trainer's end of the weight group)."""
    from rlflow.services.vllm_client import VllmBackend

    cfg = VllmRollout(max_num_seqs=16, max_tokens=64, kv_cache_bytes=64 << 20, temperature=1.0)
    backend = VllmBackend(cfg, str(tied_model), seed=0)
    backend.start_blocking()
    try:
        port = free_port("127.0.0.1")
        box = {}
        trainer = threading.Thread(
            target=lambda: box.setdefault("group", GlooGroup("127.0.0.1", port, 0, 2, timeout_s=120)), daemon=True)
        trainer.start()
        trio.run(backend.join_weights, "127.0.0.1", port, 1, 2)
        trio.run(backend.set_version, 0)  # as a rollout service does on start: tokens carry v0 until an update
        trainer.join(timeout=120)
        assert "group" in box, "the trainer's end of the weight group did not form within 120 s"
        yield backend, box["group"]
    finally:
        backend.close()


def hf_model(path, seed: int | None = None):
    """The model as transformers loads it; with `seed`, every weight perturbed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.5 * p.std().clamp(min=0.02))
    return model


def hf_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(response_ids) - 1)
    return logp[positions, torch.tensor(response_ids)].numpy()


def prompt_ids(path) -> list[int]:
    return load_tokenizer(path).encode(PROMPT, add_special_tokens=False)


async def push(engine, model, version: int, kv: str | None = None, bucket_bytes: int = 0) -> None:
    """Broadcast `model`'s weights as `version` (in pieces of at most
    `bucket_bytes`; 0: one) while vLLM receives them."""
    backend, group = engine
    specs, nbytes = layout(model.named_parameters())
    flat = pack(model.named_parameters(), specs, nbytes)

    def send() -> None:
        for piece in pieces(specs, nbytes, bucket_bytes):
            group.broadcast(flat[piece.start : piece.end].clone())

    async with trio.open_nursery() as nursery:
        # Abandoned on cancel: a broadcast with no receiver left waits for the group's timeout.
        nursery.start_soon(functools.partial(trio.to_thread.run_sync, send, abandon_on_cancel=True))
        await backend.update(version, specs, nbytes, kv=kv, bucket_bytes=bucket_bytes)


def sampled(output) -> list[tuple[list[int], np.ndarray, list]]:
    out = []
    for c in output.outputs:
        ids = list(c.token_ids)
        lps = np.array([lp[t].logprob for t, lp in zip(ids, c.logprobs)], dtype=np.float32)
        out.append((ids, lps, c.weight_versions))
    return out


def test_on_cpu_the_model_worker_runs_inside_the_engine_core(engine):
    """One process beside the rollout's, not two: vLLM's engine core holds the model worker (no
    `VLLM::Worker` process, no shared-memory queue between them), and the setting that chose it is
    not left in the rollout's environment for anything else it starts."""
    cores = [p for p in psutil.Process().children(recursive=True) if p.name() == "VLLM::EngineCore"]
    assert cores, "no engine core process"  # this engine's; another module's shared engine may run too
    beside = [p.name() for core in cores for p in core.children(recursive=True)]
    assert not [name for name in beside if "Worker" in name], beside
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ  # vLLM's own name for it


@pytest.mark.parametrize("bucket_bytes", [0, 16 << 10], ids=["whole", "pieces"])
async def test_log_probabilities_after_an_update_match_a_hf_forward_of_the_new_weights(engine, tied_model,
                                                                                       bucket_bytes):
    backend, _ = engine
    old = hf_model(tied_model)
    new = hf_model(tied_model, seed=7 + bucket_bytes)
    with trio.fail_after(120):
        await push(engine, new, version=1, bucket_bytes=bucket_bytes)
        output = await backend.generate(prompt_ids(tied_model), 8, 1.0, max_tokens=24, ignore_eos=True)
    prompt = prompt_ids(tied_model)
    worst_new, worst_old = 0.0, 0.0
    for ids, lps, versions in sampled(output):
        assert [(s.version, s.start, s.end) for s in versions] == [("1", 0, len(ids))]
        worst_new = max(worst_new, float(np.abs(lps - hf_logprobs(new, prompt, ids)).max()))
        worst_old = max(worst_old, float(np.abs(lps - hf_logprobs(old, prompt, ids)).max()))
    assert worst_new < 2e-3, f"vLLM disagrees with the new weights by {worst_new:.4f} nats"
    assert worst_old > 0.1, "the update did not change the model"


@pytest.mark.parametrize("kv", ["recompute", "keep"])
async def test_versions_are_right_across_an_update_mid_generation(engine, tied_model, kv):
    backend, _ = engine
    prompt = prompt_ids(tied_model)
    v2 = hf_model(tied_model, seed=7)
    v3 = hf_model(tied_model, seed=8)
    with trio.fail_after(180):
        await push(engine, v2, version=2)
        result = {}

        first = trio.Event()

        async def generate() -> None:
            result["out"] = await backend.generate(prompt, 4, 1.0, max_tokens=400, ignore_eos=True, first_token=first)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            await first.wait()  # mid-generation: every sample has begun
            await push(engine, v3, version=3, kv=kv)
    for ids, lps, spans in sampled(result["out"]):
        assert [s.version for s in spans] == ["2", "3"], spans
        cut = spans[1].start
        assert 0 < cut < len(ids) and spans[0].end == cut and spans[1].end == len(ids)
        # Before the update the tokens are v2's.
        assert np.abs(lps[:cut] - hf_logprobs(v2, prompt, ids)[:cut]).max() < 2e-3
        if kv == "recompute":
            # After it, v3's, with the prefix's KV cache recomputed under v3.
            assert np.abs(lps[cut:] - hf_logprobs(v3, prompt, ids)[cut:]).max() < 2e-3
        else:
            # After it, sampled with v3's weights over v2's cache of the
            # prefix: neither v2's distribution nor a recomputed v3's.
            assert np.isfinite(lps).all()
            assert np.abs(lps[cut:] - hf_logprobs(v2, prompt, ids)[cut:]).max() > 0.1
            assert np.abs(lps[cut:] - hf_logprobs(v3, prompt, ids)[cut:]).max() > 1e-2


def test_a_trainer_checkpoint_loads_in_vllm_and_transformers(tmp_path, monkeypatch):
    """The trainer's checkpoint is a model directory both load as it is."""
    from models import tiny_model as make
    from vllm import LLM, SamplingParams

    from rlflow.config import TorchTrainer
    from rlflow.services.trainer.torch_engine import TorchEngine

    path = make(tmp_path / "base", tied=False, seed=3)
    engine = TorchEngine(TorchTrainer(), str(path))
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(0.01)
    folder = tmp_path / "checkpoint"
    engine.save(folder, {"step": 1, "version": 1})
    reloaded = hf_model(folder)
    for (name, a), b in zip(engine.model.named_parameters(), reloaded.parameters()):
        assert torch.equal(a, b), name
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory_bytes=32 << 20, enforce_eager=True,
              logprobs_mode="processed_logprobs", max_num_seqs=4, seed=0)
    try:
        prompt = prompt_ids(folder)
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0),
                           use_tqdm=False)[0].outputs[0]
        ids = list(out.token_ids)
        lps = np.array([lp[t].logprob for t, lp in zip(ids, out.logprobs)])
        assert np.abs(lps - hf_logprobs(reloaded, prompt, ids)).max() < 2e-3
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    assert os.path.exists(folder / "model.safetensors")


async def test_a_request_vllm_refuses_is_failed_samples_and_the_engine_goes_on(engine, tied_model):
    """A prompt longer than the model's context: vLLM refuses the request. Its
    samples come out failed, in-band, and the next group is generated."""
    from rlflow import config as C
    from rlflow.protocol import FinishReason, PromptGroup, build_batch
    from rlflow.services.base import standalone_context
    from rlflow.services.rollout.vllm_engine import VllmEngine

    backend, _ = engine
    config = C.build({
        "pools": {"p": {}},
        "roles": {
            "rollout": {"pool": "p", "model": str(tied_model),
                        "engine": {"kind": "vllm", "max_tokens": 8, "kv_cache_bytes": 67108864}},
            "reward": {"pool": "p"},
            "trainer": {"pool": "p"},
        },
    })
    ctx = standalone_context(config, "rollout")
    vllm = VllmEngine(config.roles.rollout.engine, ctx, backend)
    too_long = PromptGroup(group_id=1, prompt_ids=[5] * 600, n=2)  # the tiny model holds 512 positions
    fine = PromptGroup(group_id=2, prompt_ids=prompt_ids(tied_model), n=2)
    finished = {}
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(vllm.run)
            vllm.submit(too_long, 0.0)
            vllm.submit(fine, 0.0)
            async for done in vllm.finished:
                finished.update((group.group_id, (group, responses)) for group, responses in done)
                if len(finished) == 2:
                    break
            nursery.cancel_scope.cancel()
    failed = build_batch([finished[1]])
    assert [r.finish_reason for r in finished[1][1]] == [FinishReason.ERROR] * 2
    assert [(f.index, f.kind) for f in failed.failures] == [(0, "engine_error"), (1, "engine_error")]
    assert "512" in failed.failures[0].message
    assert all(len(r.token_ids) > 0 and r.error is None for r in finished[2][1])
    assert ctx.counters["failed_requests"] == 1


def test_a_weight_update_waiting_when_the_engine_core_dies_ends_with_engine_dead(tied_model):
    """vLLM leaves a call made before its engine core died (pause, load
    weights) waiting forever. An engine of its own joins a weight group and
    starts an update that waits for a broadcast that never comes; its engine
    core is SIGKILLed: the update ends with vLLM's EngineDeadError (the rollout
    replica then ends, to be restarted), and closing the engine leaves no
    process of it behind."""
    from rlflow.services import compat
    from rlflow.services.vllm_client import VllmBackend

    cfg = VllmRollout(max_num_seqs=2, max_tokens=8, kv_cache_bytes=8 << 20, temperature=1.0)
    backend = VllmBackend(cfg, str(tied_model), seed=0)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    backend.start_blocking()
    group: list[GlooGroup] = []
    try:
        port = free_port("127.0.0.1")
        trainer = threading.Thread(target=lambda: group.append(GlooGroup("127.0.0.1", port, 0, 2, timeout_s=60)),
                                   daemon=True)
        trainer.start()
        trio.run(backend.join_weights, "127.0.0.1", port, 1, 2)
        trainer.join(timeout=60)
        specs, nbytes = layout(hf_model(tied_model).named_parameters())
        engine = [p for p in psutil.Process().children(recursive=True)  # vLLM titles them VLLM::EngineCore, ...
                  if p.pid not in before and ("EngineCore" in _title(p) or "Worker" in _title(p))]
        engine_core = [p for p in engine if "EngineCore" in _title(p)]
        assert len(engine_core) == 1, [_title(p) for p in engine]

        async def main() -> BaseException | None:
            async with trio.open_nursery() as nursery:
                async def kill() -> None:
                    await trio.sleep(1.0)  # the update is waiting in the engine core by then
                    engine_core[0].kill()
                nursery.start_soon(kill)
                with trio.fail_after(60):
                    try:
                        await backend.update(1, specs, nbytes)
                    except Exception as exc:  # noqa: BLE001 - the test looks at what it is
                        return exc
            return None

        raised = trio.run(main)
        assert raised is not None and compat.engine_dead(raised), raised
    finally:
        backend.close()
        for g in group:
            g.close()
    _, alive = psutil.wait_procs(engine, timeout=30)
    assert not alive, [_title(p) for p in alive]


def _title(proc) -> str:
    """A process's name and command line (vLLM titles its engine-core and worker processes)."""
    try:
        return " ".join([proc.name(), *proc.cmdline()])
    except psutil.NoSuchProcess:
        return ""


async def test_prompt_log_probabilities_for_the_teacher_match_a_hf_forward(engine, tied_model):
    """The vllm teacher backend's scores: vLLM's prompt log-probabilities, at
    temperature 1, equal a Hugging Face forward of the same weights."""
    backend, _ = engine
    weights = hf_model(tied_model, seed=7)
    with trio.fail_after(120):
        await push(engine, weights, version=10)  # whatever the tests before loaded: known weights now
        prompt = prompt_ids(tied_model)
        response = [5, 9, 11, 3, 8, 8, 14]
        positions = await backend.prompt_logprobs(prompt + response, 3)
    expected = hf_logprobs(weights, prompt, response)
    got = np.array([positions[len(prompt) + j][t].logprob for j, t in enumerate(response)])
    assert np.abs(got - expected).max() < 2e-3
    top = {t for t, lp in positions[len(prompt)].items() if lp.rank <= 3}
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = weights(input_ids=ids).logits[0, len(prompt) - 1]
    assert top == set(torch.topk(logits, 3).indices.tolist())


async def test_episodes_on_vllm_are_the_sequences_vllm_generated_over(engine, tied_model):
    """Two-turn episodes (the default task's second try) on vLLM: each model
    token's log-probability, as vLLM sampled it, is vLLM's own log-probability
    of that token given the episode's stored sequence before it (the hint
    included), so the stored sequence is exactly what it generated over."""
    import contextlib

    from rlflow import config as C
    from rlflow.env import EnvHandler, open_env_pool
    from rlflow.env.render import EpisodeText
    from rlflow.protocol import PromptGroup
    from rlflow.services.base import standalone_context
    from rlflow.services.rollout.envclient import InlineEnv
    from rlflow.services.rollout.episodes import EpisodeRunner
    from rlflow.services.rollout.vllm_engine import VllmEngine

    backend, _ = engine
    config = C.build({
        "pools": {"p": {}},
        "roles": {
            "rollout": {"pool": "p", "model": str(tied_model),
                        "engine": {"kind": "vllm", "max_tokens": 24, "kv_cache_bytes": 67108864}},
            "reward": {"pool": "p"},
            "trainer": {"pool": "p"},
            "env": {"pool": "p", "environment": {"path": "rlflow.env.arith:SecondTry"}, "max_turns": 2,
                    "max_tokens": 200},
        },
    })
    ctx = standalone_context(config, "rollout")
    vllm = VllmEngine(config.roles.rollout.engine, ctx, backend)
    tokenizer = load_tokenizer(tied_model)

    class Row:
        def row(self, group_id):
            return {"a": 57, "b": 68}

    env = config.roles.env
    async with open_env_pool(env.environment, workers=1) as pool, trio.open_nursery() as nursery:
        await nursery.start(vllm.run)
        handler = EnvHandler(pool, tools=[], timeout_s=5, counters=ctx.counters)
        runner = EpisodeRunner(vllm, InlineEnv(handler, contextlib.nullcontext), Row(), env, turn_tokens=24,
                               text=EpisodeText(tokenizer), counters=ctx.counters, holds=1)
        with trio.fail_after(120):
            group, responses = await runner.play(PromptGroup(group_id=0, prompt_ids=[], n=4, reference="125"), 0.0)
            seconds = [r for r in responses if r.loss_mask is not None and (r.loss_mask == 0).any()]
            assert seconds, "a random model answers 57+68 wrong, and gets a second try"
            for r in seconds:
                ids = list(group.prompt_ids) + r.token_ids.tolist()
                scored = await backend.prompt_logprobs(ids, 1)
                start = len(group.prompt_ids)
                own = [start + i for i in np.flatnonzero(r.loss_mask)]
                vllm_then = [scored[p][ids[p]].logprob for p in own]
                np.testing.assert_allclose(r.logprobs[r.loss_mask == 1], vllm_then, atol=2e-3)
                hint = tokenizer.decode(r.token_ids[r.loss_mask == 0].tolist())
                assert hint.startswith("57+68=7+8=15,")
        nursery.cancel_scope.cancel()


#: A chat template in the arith alphabet (each message's text, then the end of a turn).
ARITH_CHAT = "{% for m in messages %}{{ m['content'] }}<eos>{% endfor %}{% if add_generation_prompt %}={% endif %}"

#: An agent that takes an episode, plays one turn, and waits to be killed.
STUCK_AGENT = """
import httpx, openai, sys, time
url, key = sys.argv[1], sys.argv[2]
episode = httpx.post(url + "/rlflow/episodes", json={"wait_s": 30}, headers={"Authorization": "Bearer " + key}).json()
llm = openai.OpenAI(base_url=episode["base_url"], api_key=key, max_retries=0)
llm.completions.create(model="policy", prompt=episode["prompt"], max_tokens=4)
print("played", flush=True)
time.sleep(600)
"""


def agents_endpoint(engine, tied_model, *, max_turns: int):
    """The agents' endpoint of a vLLM replica on the shared engine, its episodes scored by their agents
    (key "right-key"), a chat template on the arith tokenizer: (replica's engine, endpoint, tokenizer,
    service context)."""
    from rlflow import config as C
    from rlflow.env.render import EpisodeText
    from rlflow.services import compat
    from rlflow.services.base import standalone_context
    from rlflow.services.rollout.agents import AgentEndpoint
    from rlflow.services.rollout.vllm_engine import VllmEngine

    backend, _ = engine
    config = C.build({
        "pools": {"p": {}},
        "roles": {
            "rollout": {"pool": "p", "model": str(tied_model),
                        "engine": {"kind": "vllm", "max_tokens": 24, "kv_cache_bytes": 67108864}},
            "reward": {"pool": "p", "engine": {"kind": "env"}},
            "trainer": {"pool": "p"},
        },
        "agents": {"max_turns": max_turns, "max_tokens": 200, "idle_timeout_s": 2.0, "api_key": "right-key"},
    })
    ctx = standalone_context(config, "rollout")
    vllm = VllmEngine(config.roles.rollout.engine, ctx, backend)
    tokenizer = load_tokenizer(tied_model)
    tokenizer.chat_template = ARITH_CHAT

    class Task:
        def row(self, group_id):
            return {"a": 57, "b": 68}

        def decode(self, ids):
            return tokenizer.decode(list(ids), skip_special_tokens=True)

    endpoint = AgentEndpoint(vllm, Task(), config.agents, text=EpisodeText(tokenizer), turn_tokens=24,
                             make_parser=lambda tools: compat.tool_parser("hermes", tokenizer, tools),
                             counters=ctx.counters, api_key="right-key", rank=0, replicas=1, takes_reward=True,
                             holds=2)
    return vllm, endpoint, tokenizer, ctx


@contextlib.asynccontextmanager
async def one_group_served(vllm, endpoint, tokenizer, n: int):
    """The replica's engine and endpoint running, group 0 ("57+68=", `n` samples) handed to them; yields
    the prompt's token ids. Both stop on the way out."""
    from rlflow.protocol import PromptGroup

    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            await nursery.start(vllm.run)
            await nursery.start(endpoint.run)
            prompt = tokenizer.encode("57+68=", add_special_tokens=False)
            endpoint.submit(PromptGroup(group_id=0, prompt_ids=prompt, n=n, reference="125"), time.time())
            yield prompt
            nursery.cancel_scope.cancel()


async def test_agents_over_the_openai_api_train_on_what_vllm_sampled(engine, tied_model):
    """Outside agents on the real `openai` client against a vLLM replica's endpoint: every token of an
    episode's sample at loss mask 1 is a token the endpoint returned (with its log-probability), each
    turn was generated over exactly the recorded tokens before it, a weight update between two turns
    labels the second turn with the new version, chat completions (streamed, with tools) and
    completions share one group, a wrong key is refused, and a killed agent's group is abandoned."""
    import subprocess
    import sys

    import httpx
    import openai

    from rlflow.protocol import PromptGroup

    vllm, endpoint, tokenizer, ctx = agents_endpoint(engine, tied_model, max_turns=3)
    url = endpoint.bind()
    key = {"Authorization": "Bearer right-key"}
    newer = hf_model(tied_model, seed=11)

    def take() -> dict:
        return httpx.post(f"{url}/rlflow/episodes", json={"wait_s": 10}, headers=key).json()

    async def call(fn, *args, **kwargs):
        return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

    clients = []

    def client(base_url: str, api_key: str) -> openai.OpenAI:
        clients.append(openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0))
        return clients[-1]

    async with one_group_served(vllm, endpoint, tokenizer, n=2) as prompt:
        with pytest.raises(openai.AuthenticationError):
            await call(client(f"{url}/v1", "wrong").models.list)

        # Completions, two turns with a weight update between them.
        episode = await call(take)
        llm = client(episode["base_url"], "right-key")
        extra = {"return_token_ids": True}
        first = await call(llm.completions.create, model="policy", prompt=episode["prompt"], max_tokens=12,
                           logprobs=1, extra_body=extra)
        assert first.choices[0].model_extra["token_ids"]
        await push(engine, newer, version=100)
        hint = "57+68=7+8=15,"
        second = await call(llm.completions.create, model="policy", prompt=episode["prompt"] + first.choices[0].text
                            + hint, max_tokens=12, logprobs=1, extra_body=extra)
        ended = await call(httpx.post, f"{url}/rlflow/episodes/{episode['id']}/end", json={"reward": 0.5},
                           headers=key)
        assert ended.status_code == 200, ended.text

        # Chat, streamed, with a tool's result between the turns.
        chat = await call(take)
        llm = client(chat["base_url"], "right-key")
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
        messages = [{"role": "user", "content": "57+68"}]
        reply = await call(llm.chat.completions.create, model="policy", messages=messages, tools=tools,
                           max_tokens=10, logprobs=True, extra_body=extra)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "tool", "content": "125", "tool_call_id": "call_0"}]

        def streamed():
            stream = llm.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=10,
                                                 stream=True, logprobs=True, extra_body=extra)
            return list(stream)

        chunks = await call(streamed)
        last = chunks[-1].choices[0]
        assert last.finish_reason in ("stop", "length")
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == tokenizer.decode(
            last.model_extra["token_ids"], skip_special_tokens=True)
        # A turn asked for with no new message: the template's generation prompt goes before it.
        messages.append({"role": "assistant", "content": tokenizer.decode(last.model_extra["token_ids"],
                                                                          skip_special_tokens=True)})
        # Streamed with no tools nor stop strings: the text as the engine makes it, the role first.

        def live():
            return list(llm.chat.completions.create(model="policy", messages=messages, max_tokens=8, stream=True,
                                                    extra_body=extra))

        pieces = await call(live)
        assert pieces[0].choices[0].delta.role == "assistant" and pieces[-1].choices[0].finish_reason is not None
        third_ids = pieces[-1].choices[0].model_extra["token_ids"]
        assert "".join(p.choices[0].delta.content or "" for p in pieces) == tokenizer.decode(
            third_ids, skip_special_tokens=True)
        assert pieces[0].model_extra["prompt_token_ids"][-1] == tokenizer.convert_tokens_to_ids("=")
        ended = await call(httpx.post, f"{url}/rlflow/episodes/{chat['id']}/end", json={"reward": 0.0},
                           headers=key)
        assert ended.status_code == 200, ended.text
        [(group, (played, chatted))] = await endpoint.finished.receive()

        # A killed agent: its group is dropped, and its episode is gone.
        endpoint.submit(PromptGroup(group_id=1, prompt_ids=prompt, n=1, reference="125"), time.time())
        agent = subprocess.Popen([sys.executable, "-c", STUCK_AGENT, url, "right-key"], stdout=subprocess.PIPE,
                                 text=True)
        try:
            assert await call(agent.stdout.readline) == "played\n"
            agent.kill()
            agent.wait()
            given = await endpoint.given_up.receive()
            assert given.group_id == 1 and not given.again and "agents.idle_timeout_s" in given.why
        finally:
            agent.kill()
            agent.wait()
            agent.stdout.close()

    for each in clients:
        each.close()
    turns = [first.choices[0], second.choices[0]]
    sample = list(group.prompt_ids) + played.token_ids.tolist()
    own = np.flatnonzero(played.loss_mask)
    # Every trained token is one the engine returned, with the log-probability it sampled it at.
    assert [sample[len(group.prompt_ids) + i] for i in own] == sum((t.model_extra["token_ids"] for t in turns), [])
    np.testing.assert_allclose(played.logprobs[own], sum((t.logprobs.token_logprobs for t in turns), []), atol=1e-6)
    # The second turn was generated over the recorded tokens: the first turn's and the hint's.
    second_at = len(group.prompt_ids) + own[len(turns[0].model_extra["token_ids"])]
    assert turns[1].model_extra["prompt_token_ids"] == sample[:second_at]
    assert tokenizer.decode(sample[second_at - len(tokenizer.encode(hint, add_special_tokens=False)):second_at]) \
        == hint
    # The update between the turns: the first turn's tokens are older, the second's the new version.
    versions = played.versions[own]
    cut = len(turns[0].model_extra["token_ids"])
    assert (versions[:cut] < 100).all() and (versions[cut:] == 100).all()
    # The chat episode: its sample is the first prompt the template rendered, then its turns.
    chat_sample = list(group.prompt_ids) + chatted.token_ids.tolist()
    assert chat_sample[:len(reply.model_extra["prompt_token_ids"])] == reply.model_extra["prompt_token_ids"]
    mine = np.flatnonzero(chatted.loss_mask)
    assert [chat_sample[len(group.prompt_ids) + i] for i in mine] == \
        reply.choices[0].model_extra["token_ids"] + last.model_extra["token_ids"] + third_ids
    assert ctx.counters["agents.abandoned"] == 1 and ctx.counters["agents.refused_key"] == 1


async def test_agents_stop_strings_cut_the_trained_turn_and_what_the_endpoint_cannot_do_is_refused(engine, tied_model):
    """`stop`: a turn ends before its first stop string, and the trainer gets the tokens the agent read
    and no more; `tool_choice` other than auto or none (forcing a call), a prompt that fills the model's
    context and a temperature other than the run's are each answered 400 naming why."""

    import httpx


    vllm, endpoint, tokenizer, _ = agents_endpoint(engine, tied_model, max_turns=2)
    url = endpoint.bind()
    key = {"Authorization": "Bearer right-key"}
    stops = ["#", "=="]  # the tiny model writes "#" among its digits

    async def post(path: str, body: dict) -> httpx.Response:
        return await trio.to_thread.run_sync(functools.partial(httpx.post, f"{url}{path}", json=body, headers=key))

    async with one_group_served(vllm, endpoint, tokenizer, n=1):
        episode = (await post("/rlflow/episodes", {"wait_s": 10})).json()
        base = episode["base_url"].removeprefix(url)
        forced = await post(f"{base}/chat/completions", {
            "model": "policy", "messages": [{"role": "user", "content": "57+68"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]})
        assert forced.status_code == 400 and "tool_choice 'required'" in forced.json()["error"]["message"]
        long = await post(f"{base}/completions", {"model": "policy", "prompt": [5] * 512, "max_tokens": 4})
        assert long.status_code == 400, long.text
        assert long.json()["error"]["code"] == "context_length_exceeded" and "context 512" in long.text
        colder = await post(f"{base}/completions", {"model": "policy", "prompt": "1", "temperature": 0.2})
        assert colder.status_code == 400 and "temperature 0.2: this run samples at temperature 1.0" in colder.text
        said = (await post(f"{base}/completions", {"model": "policy", "prompt": episode["prompt"], "stop": stops,
                                                    "temperature": 1.0, "return_token_ids": True})).json()
        assert said["system_fingerprint"] is None  # the run's own temperature: nothing overridden
        said = said["choices"][0]
        ended = await post(f"/rlflow/episodes/{episode['id']}/end", {"reward": 1.0})
        assert ended.status_code == 200, ended.text
        [(group, [played])] = await endpoint.finished.receive()

    assert not any(stop in said["text"] for stop in stops)
    assert said["finish_reason"] == "stop" or len(said["token_ids"]) == 24
    assert tokenizer.decode(said["token_ids"], skip_special_tokens=True) == said["text"]
    # The trained turn is the returned one, token for token.
    sample = list(group.prompt_ids) + played.token_ids.tolist()
    own = np.flatnonzero(played.loss_mask)
    assert [sample[len(group.prompt_ids) + i] for i in own] == said["token_ids"]
    assert len(played.logprobs[own]) == len(said["token_ids"])
