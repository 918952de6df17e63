"""LoRA end to end on real vLLM on CPU: the trainer's adapter (PEFT, on a
frozen tiny Qwen2) goes over the gloo weight group into vLLM's LoRA manager,
and what vLLM then serves is the trainer's policy.

One vLLM engine with LoRA serves the session; the test process plays the
trainer (a `TorchEngine` of one rank), sending its adapter as the trainer
service does.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import trio
from models import tiny_model

from rlflow import config as C
from rlflow.data.net import free_port
from rlflow.protocol import WeightsGloo
from rlflow.services.base import standalone_context
from rlflow.services.trainer.torch_engine import TorchEngine
from rlflow.services.weights import GlooGroup
from rlflow.tasks.core import load_tokenizer

pytestmark = pytest.mark.vllm

#: Rank and the number of versions per request keeps (max_staleness + 1).
RANK, STALENESS = 8, 1

@pytest.fixture(scope="session")
def base(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("lora") / "base", tied=False, seed=3)


def lora_config(base, update: str = "in_place", kv: str = "recompute", transfer: str = "group") -> C.Config:
    return C.build({
        "pools": {"p": {}},
        "roles": {
            "rollout": {"pool": "p", "model": str(base), "engine": {
                "kind": "vllm", "max_num_seqs": 16, "max_tokens": 24, "kv_cache_bytes": 67108864, "kv_on_update": kv}},
            "reward": {"pool": "p"},
            "trainer": {"pool": "p", "engine": {"kind": "torch", "lr": 0.02, "lora": {
                "rank": RANK, "alpha": 16, "adapter_update": update, "transfer": transfer}}},
        },
        "run": {"max_staleness": STALENESS},
    })


@pytest.fixture(scope="session")
def served(base):
    """(vLLM backend with LoRA, the trainer's end of the weight group, its port)."""
    from rlflow.services.rollout.vllm_engine import VllmBackend, adapter_slots

    config = lora_config(base)
    backend = VllmBackend(config.roles.rollout.engine, str(base), seed=0, lora_rank=RANK,
                          lora_slots=adapter_slots("per_request", STALENESS))
    backend.start_blocking()
    try:
        port = free_port("127.0.0.1")
        box = {}
        trainer = threading.Thread(target=lambda: box.setdefault("group", GlooGroup("127.0.0.1", port, 0, 2)))
        trainer.start()
        trio.run(backend.join_weights, "127.0.0.1", port, 1, 2)
        trainer.join()
        yield backend, box["group"], port
    finally:
        backend.close()


class Trainer:
    """The trainer's side: a LoRA `TorchEngine` whose adapter is moved a
    little at each version (as a step would), and its sends."""

    def __init__(self, config: C.Config, group: GlooGroup | None, engine: TorchEngine | None = None):
        from rlflow.services.trainer.lora import adapter_offer

        self.engine = engine or TorchEngine(config.roles.trainer.engine, config.policy_path)
        self.adapter = adapter_offer(self.engine.lora, config.run.max_staleness)
        self.group = group
        self.seed = 0

    def step(self) -> None:
        """New adapter weights, far enough from the last to tell them apart."""
        self.seed += 1
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for p in self.engine.model.parameters():
                if p.requires_grad:  # (a trainer service's engine is sharded: one shard, the whole)
                    (p.to_local() if hasattr(p, "to_local") else p).add_(
                        torch.randn(p.shape, generator=generator) * 0.3)

    def publish(self) -> tuple[list[torch.Tensor], str]:
        snapshot = self.engine.snapshot()
        return snapshot, self.engine.checksum(snapshot)

    def send(self, snapshot: list[torch.Tensor]) -> None:
        self.engine.send(snapshot, self.group.broadcast)

    def adapter_now(self) -> dict[str, torch.Tensor]:
        """A copy of the adapter's weights now (to score with later)."""
        return {n: p.detach().clone() for n, p in self.engine.model.named_parameters() if p.requires_grad}

    def logprobs(self, prompt: list[int], response: list[int], *, adapter: bool | dict = True) -> np.ndarray:
        """The trainer's model's log-probabilities of `response` (a Hugging Face
        + PEFT forward; `adapter` False: the base; a dict: under those adapter
        weights (`adapter_now`), else the current ones)."""
        model = self.engine.model
        ids = torch.tensor([prompt + response])
        saved = self.adapter_now() if isinstance(adapter, dict) else {}
        try:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in saved:
                        p.copy_(adapter[n])
                if adapter is False:
                    with model.disable_adapter():
                        logits = model(input_ids=ids).logits[0]
                else:
                    logits = model(input_ids=ids).logits[0]
        finally:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in saved:
                        p.copy_(saved[n])
        logp = torch.log_softmax(logits.float(), -1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        return logp[positions, torch.tensor(response)].numpy()


def rollout(config: C.Config, served, trainer: Trainer):
    """rlflow's vLLM engine over the session's backend, joined to the group."""
    from rlflow.services.rollout.vllm_engine import VllmEngine

    backend, _, port = served
    joined = (WeightsGloo(host="127.0.0.1", port=port, world_size=2, rank=1, nbytes=trainer.engine.nbytes,
                          bucket_bytes=trainer.engine.cfg.bucket_bytes), [])
    return VllmEngine(config.roles.rollout.engine, standalone_context(config, "rollout"), backend, joined)


async def start(engine, trainer: Trainer) -> None:
    """As the rollout service starts: version 0, then the welcome's layout and adapter."""
    await engine.start()
    await engine.join_weights(None, trainer.engine.specs, trainer.adapter)


async def update(engine, trainer: Trainer, version: int) -> str:
    """The trainer publishes and sends `version` while the rollout takes it; the trainer's checksum."""
    snapshot, checksum = trainer.publish()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, trainer.send, snapshot)
        await engine.update_weights(version, None)
    return checksum


def prompt_ids(base) -> list[int]:
    return load_tokenizer(base).encode("12+34=", add_special_tokens=False)


def sampled(output) -> list[tuple[list[int], np.ndarray, list]]:
    out = []
    for c in output.outputs:
        ids = list(c.token_ids)
        out.append((ids, np.array([lp[t].logprob for t, lp in zip(ids, c.logprobs)], np.float32), c.weight_versions))
    return out


async def test_vllm_under_the_received_adapter_matches_a_hf_peft_forward_of_the_trainers(base, served):
    config = lora_config(base)
    trainer = Trainer(config, served[1])
    engine = rollout(config, served, trainer)
    prompt = prompt_ids(base)
    with trio.fail_after(180):
        await start(engine, trainer)
        trainer.step()
        sent = await update(engine, trainer, 1)
        output = await engine.backend.generate(prompt, 8, 1.0, max_tokens=20, ignore_eos=True,
                                               lora_id=engine.served.lora_id(1))
    # The rollout reports the checksum of what it received: the trainer's.
    assert engine.checksum == sent and sent.startswith("crc32:")
    worst, off_base = 0.0, 0.0
    for ids, lps, versions in sampled(output):
        assert [s.version for s in versions] == ["1"]
        worst = max(worst, float(np.abs(lps - trainer.logprobs(prompt, ids)).max()))
        off_base = max(off_base, float(np.abs(lps - trainer.logprobs(prompt, ids, adapter=False)).max()))
    assert worst < 2e-3, f"vLLM under the received adapter disagrees with HF + PEFT by {worst:.4f} nats"
    assert off_base > 0.1, "the adapter changed nothing"


async def test_the_served_policy_changes_at_the_first_update(base, served):
    """The silent failure of an adapter that never reaches the rollout: the
    base goes on being served and looks like nothing worse than staleness.
    Before any update the rollout serves the base (version 0: B = 0); after
    the first, the trainer's adapter, which vLLM lists."""
    from rlflow.services.rollout.vllm_engine import IN_PLACE_ID

    config = lora_config(base)
    trainer = Trainer(config, served[1])
    engine = rollout(config, served, trainer)
    backend = engine.backend
    prompt = prompt_ids(base)
    with trio.fail_after(180):
        await start(engine, trainer)
        before = await backend.generate(prompt, 4, 1.0, max_tokens=16, ignore_eos=True,
                                        lora_id=engine.served.lora_id(0))
        trainer.step()
        sent = await update(engine, trainer, 1)
        after = await backend.generate(prompt, 4, 1.0, max_tokens=16, ignore_eos=True, lora_id=engine.served.lora_id(1))
        held = set(await backend.call(backend.llm.list_loras))
    assert held == {IN_PLACE_ID} and engine.checksum == sent
    for ids, lps, _ in sampled(before):
        assert np.abs(lps - trainer.logprobs(prompt, ids, adapter=False)).max() < 2e-3
    for ids, lps, _ in sampled(after):
        assert np.abs(lps - trainer.logprobs(prompt, ids)).max() < 2e-3
        assert np.abs(lps - trainer.logprobs(prompt, ids, adapter=False)).max() > 0.1, "still the base"


async def test_over_zeromq_each_replica_fetches_the_adapter_from_the_trainers_weight_server(base, served):
    """`lora.transfer = "zmq"`: the trainer service's engine serves each
    version from its weight server (a ROUTER) and joins no group; the rollout
    fetches the version it is told to load (or a newer one), checks it against
    the layout, and vLLM then serves the trainer's policy."""
    from rlflow.protocol import Tensor, WeightsPayload, WeightsZmq
    from rlflow.services.rollout.vllm_engine import VllmEngine
    from rlflow.services.trainer.torch_trainer import TorchTrainerEngine

    config = lora_config(base, transfer="zmq")
    serving = TorchTrainerEngine(config.roles.trainer.engine, standalone_context(config, "trainer"))
    trainer = Trainer(config, None, serving.engine)
    engine = VllmEngine(config.roles.rollout.engine, standalone_context(config, "rollout"), served[0])
    prompt = prompt_ids(base)
    checksums = {}
    try:
        with trio.fail_after(180):
            async with trio.open_nursery() as nursery:
                await nursery.start(serving.serve)
                offer, layout = serving.offer()
                assert isinstance(offer, WeightsZmq) and serving.adapter == trainer.adapter
                await serving.connect(offer)  # nothing to host: it returns at once
                await engine.start()
                await engine.join_weights(offer, layout, serving.adapter)
                trainer.step()
                checksums[1] = (await serving.publish(1))[1]
                await serving.send(1, None)
                assert await engine.update_weights(1, None) == 1
                output = await engine.backend.generate(prompt, 4, 1.0, max_tokens=16, ignore_eos=True,
                                                       lora_id=engine.served.lora_id(1))
                v1 = trainer.adapter_now()
                # Two versions published before the rollout asks for the first: it takes the newest.
                for version in (2, 3):
                    trainer.step()
                    checksums[version] = (await serving.publish(version))[1]
                assert await engine.update_weights(2, None) == 3
                newest = engine.checksum
                # A server that sends something else than the layout's adapter is refused, naming it.
                names = [s.name for s in layout]
                wrong = [Tensor.from_torch(torch.zeros(s.shape)) for s in layout]
                serving.server.publish(WeightsPayload(version=4, names=names[:-1] + ["lm_head.weight"], tensors=wrong))
                with pytest.raises(ValueError, match="lm_head.weight"):
                    await engine.update_weights(4, None)
                nursery.cancel_scope.cancel()
    finally:
        await serving.close()
    assert engine.checksum == newest == checksums[3] and checksums[1] != checksums[3]
    for ids, lps, versions in sampled(output):
        assert [s.version for s in versions] == ["1"]
        assert np.abs(lps - trainer.logprobs(prompt, ids, adapter=v1)).max() < 2e-3
        assert np.abs(lps - trainer.logprobs(prompt, ids, adapter=False)).max() > 0.1, "still the base"


async def test_an_episodes_turn_is_generated_under_the_adapter(base, served):
    """A multi-turn episode asks the engine for each turn: a turn, like a
    group, runs under the adapter served, not the bare base."""
    config = lora_config(base)
    trainer = Trainer(config, served[1])
    engine = rollout(config, served, trainer)
    prompt = prompt_ids(base)
    with trio.fail_after(180):
        await start(engine, trainer)
        trainer.step()
        await update(engine, trainer, 1)
        turn = await engine.generate(prompt, max_tokens=16, temperature=1.0)
    ids = [int(t) for t in turn.token_ids]
    assert ids and list(turn.versions) == [1] * len(ids)
    assert np.abs(turn.logprobs - trainer.logprobs(prompt, ids)).max() < 2e-3
    assert np.abs(turn.logprobs - trainer.logprobs(prompt, ids, adapter=False)).max() > 0.1, "the bare base"


async def test_in_place_the_adapter_changes_mid_generation_and_later_tokens_carry_the_new_version(base, served):
    config = lora_config(base, "in_place", kv="recompute")
    trainer = Trainer(config, served[1])
    engine = rollout(config, served, trainer)
    prompt = prompt_ids(base)
    result, first = {}, trio.Event()
    with trio.fail_after(240):
        await start(engine, trainer)
        trainer.step()
        await update(engine, trainer, 1)
        v1 = trainer.adapter_now()

        async def generate() -> None:
            result["out"] = await engine.backend.generate(prompt, 4, 1.0, max_tokens=400, ignore_eos=True,
                                                          first_token=first, lora_id=engine.served.lora_id(1))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            await first.wait()
            trainer.step()
            await update(engine, trainer, 2)
    for ids, lps, spans in sampled(result["out"]):
        assert [s.version for s in spans] == ["1", "2"], spans
        cut = spans[1].start
        assert 0 < cut < len(ids)
        assert np.abs(lps[:cut] - trainer.logprobs(prompt, ids, adapter=v1)[:cut]).max() < 2e-3
        # After it the new adapter's, over a KV cache recomputed under it.
        assert np.abs(lps[cut:] - trainer.logprobs(prompt, ids)[cut:]).max() < 2e-3


async def test_per_request_a_request_keeps_its_version_and_an_old_one_is_let_go_of_after_its_last_request(
        base, served):
    """Per request: a request started on v1 runs to its end on v1 while v2
    and v3 arrive; v3 pushes v1 out of the last max_staleness + 1 = 2
    versions, and vLLM lets go of it only once that request has ended."""
    from rlflow.protocol import FinishReason, PromptGroup

    config = lora_config(base, "per_request")
    trainer = Trainer(config, served[1])
    engine = rollout(config, served, trainer)
    backend = engine.backend
    prompt = prompt_ids(base)
    result, first = {}, trio.Event()
    with trio.fail_after(300):
        await start(engine, trainer)
        trainer.step()
        await update(engine, trainer, 1)
        v1, id1 = trainer.adapter_now(), engine.served.lora_id(1)

        async def generate() -> None:
            result["out"] = await backend.generate(prompt, 2, 1.0, max_tokens=400, ignore_eos=True,
                                                   first_token=first, lora_id=id1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            await first.wait()
            for version in (2, 3):
                trainer.step()
                await update(engine, trainer, version)
            # v1 is out of the window but still in use: held until its request ends.
            result["during"] = set(await backend.call(backend.llm.list_loras))
        result["after"] = set(await backend.call(backend.llm.list_loras))
        # A group started now runs on v3 (every token of it).
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            engine.submit(PromptGroup(group_id=1, prompt_ids=prompt, n=2), 0.0)
            (done,) = await engine.finished.receive()
            nursery.cancel_scope.cancel()
    assert sorted(engine.served.ids) == [2, 3]
    assert id1 in result["during"] and result["after"] == {engine.served.lora_id(2), engine.served.lora_id(3)}
    for ids, lps, _ in sampled(result["out"]):
        assert len(ids) == 400
        assert np.abs(lps - trainer.logprobs(prompt, ids, adapter=v1)).max() < 2e-3, "not v1 to the end"
    group, responses = done
    for r in responses:
        assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and (r.versions == 3).all()
        assert np.abs(r.logprobs - trainer.logprobs(prompt, r.token_ids.tolist())).max() < 2e-3


async def test_a_trainer_checkpoints_adapter_loads_in_vllm_from_its_directory(base, served, tmp_path):
    """PEFT's format, as vLLM's own loader reads it: the checkpoint's adapter
    served from its folder is the trainer's policy."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    config = lora_config(base)
    trainer = Trainer(config, served[1])
    trainer.step()
    trainer.engine.save(tmp_path / "step-000001", {"step": 1, "version": 1})
    backend = served[0]
    prompt = prompt_ids(base)
    params = SamplingParams(n=4, max_tokens=16, ignore_eos=True, logprobs=0)
    request = LoRARequest("checkpoint", 77, str(tmp_path / "step-000001" / "adapter"))

    async def run():
        final = None
        async for out in backend.llm.generate({"prompt_token_ids": prompt}, params, "checkpoint",
                                              lora_request=request):
            final = out
        await backend.llm.remove_lora(77)
        return final

    with trio.fail_after(120):
        output = await backend.call(run)
    for ids, lps, _ in sampled(output):
        assert np.abs(lps - trainer.logprobs(prompt, ids)).max() < 2e-3


async def test_per_request_a_group_still_on_a_version_that_falls_out_is_started_again_on_the_newest(base, served):
    """Its slots full (requests of the base that run long), the engine holds a
    group that started on v1 when v2 and v3 arrive: v1 falls out of the last
    max_staleness + 1 versions, so the group starts again, and all of it is v3."""
    from rlflow.protocol import PromptGroup

    config = lora_config(base, "per_request")
    trainer = Trainer(config, served[1])
    engine = rollout(config, served, trainer)
    backend = engine.backend
    prompt = prompt_ids(base)
    with trio.fail_after(300):
        await start(engine, trainer)
        trainer.step()
        await update(engine, trainer, 1)
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            full = trio.Event()
            for _ in range(2):  # 2 x 8 sequences: every slot (max_num_seqs = 16)
                nursery.start_soon(lambda: backend.generate(prompt, 8, 1.0, max_tokens=300, ignore_eos=True,
                                                            first_token=full))
            await full.wait()
            engine.submit(PromptGroup(group_id=5, prompt_ids=prompt, n=2), 0.0)
            await trio.sleep(0.1)
            assert engine.running[5].submitted_version == 1
            for version in (2, 3):
                trainer.step()
                await update(engine, trainer, version)
            (done,) = await engine.finished.receive()
            nursery.cancel_scope.cancel()
    assert engine.ctx.counters["restarted_groups"] == 1
    group, responses = done
    assert group.group_id == 5
    for r in responses:
        assert (r.versions == 3).all()
        assert np.abs(r.logprobs - trainer.logprobs(prompt, r.token_ids.tolist())).max() < 2e-3


#: The run below, less its model.
E2E = {
    "pools": {"generate": {"cpus_per_bundle": 1.0}, "train": {"cpus_per_bundle": 1.0}},
    # vLLM's start (with LoRA) was past 290 s on a 2-core machine busy with other work (about 10 s alone).
    "cluster": {"handshake_timeout_s": 900},
    "roles": {
        "rollout": {"pool": "generate", "engine": {
            "kind": "vllm", "max_num_seqs": 32, "max_tokens": 24, "kv_cache_bytes": 33554432}},
        "reward": {"pool": "generate", "engine": {"kind": "task"}},
        "trainer": {"pool": "train", "engine": {
            "kind": "torch", "lr": 1e-2, "checkpoint_every": 2, "kl_coef": 0.05, "lora": {"rank": 8, "alpha": 16}}},
    },
    "task": {"kind": "arith", "heldout_size": 24},
    "eval": {"every_steps": 2},
    "run": {"mode": "async", "batch_size": 4, "samples_per_prompt": 4, "steps": 3},
}


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(1800)  # two whole real-vLLM runs, whose starts alone took minutes on a busy machine
def test_a_lora_run_end_to_end_and_its_resume_per_request_over_zeromq(ray_cluster, tmp_path):
    """A few steps with an adapter in place over the gloo group and a KL
    penalty to the base (no teacher role), every update's checksum checked;
    then the run resumes from its checkpoint (base from the model, adapter and
    optimizer from the checkpoint) with one adapter version per request, the
    rollout fetching each from the trainer's weight server."""
    from rlflow.control.launch import run
    from rlflow.rundir import RunDir

    model = tiny_model(tmp_path / "model", tied=False, seed=11)
    run_dir = tmp_path / "run"
    summary = run(C.build(E2E, {"roles": {"rollout": {"model": str(model)}}}), run_dir)
    assert summary.state == "stopped", summary.error
    folder = RunDir(run_dir)
    assert [r.step for r in folder.read_metrics()] == [0, 1, 2]
    # Every version moved to the rollout was the trainer's, checksum for checksum.
    assert summary.weights_checked >= 2
    evals = folder.read_evals()
    assert evals[0].version == 0 and evals[-1].version == 3
    for name in ("step-000002", "step-000003"):
        checkpoint = run_dir / "checkpoints" / name
        assert (checkpoint / "adapter" / "adapter_model.safetensors").exists()
        assert not (checkpoint / "model.safetensors").exists()  # the adapter alone: no merged model asked for

    resumed = C.load(folder.config, [f'run.resume="{run_dir / "checkpoints" / "step-000003"}"', "run.steps=5",
                                     'roles.trainer.engine.lora.adapter_update="per_request"',
                                     'roles.trainer.engine.lora.transfer="zmq"'])
    summary = run(resumed, run_dir)
    assert summary.state == "stopped", summary.error
    steps = folder.read_metrics()
    assert [r.step for r in steps][-2:] == [3, 4] and steps[-1].version == 5
    assert summary.weights_checked >= 1
