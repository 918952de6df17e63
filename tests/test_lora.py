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
from rlflow.data.tasks import load_tokenizer
from rlflow.protocol import WeightsGloo
from rlflow.services.base import standalone_context
from rlflow.services.trainer.torch_engine import TorchEngine
from rlflow.services.weights import GlooGroup

pytestmark = pytest.mark.vllm

#: Rank and the number of versions per request keeps (max_staleness + 1).
RANK, STALENESS = 8, 1

CONFIG = """
[pools.p]
[roles.rollout]
pool = "p"
model = "{model}"
engine = {{ kind = "vllm", max_num_seqs = 16, max_tokens = 24, kv_cache_bytes = 67108864, kv_on_update = "{kv}" }}
[roles.reward]
pool = "p"
[roles.trainer]
pool = "p"
engine = {{ kind = "torch", lr = 0.02, lora = {{ rank = {rank}, alpha = 16, adapter_update = "{update}" }} }}
[run]
max_staleness = {staleness}
"""


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("lora") / "base", tied=False, seed=3)


def lora_config(base, update: str = "in_place", kv: str = "recompute") -> C.Config:
    return C.load(text=CONFIG.format(model=base, rank=RANK, update=update, kv=kv, staleness=STALENESS))


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

    def __init__(self, config: C.Config, group: GlooGroup):
        from rlflow.services.trainer.lora import adapter_offer

        self.engine = TorchEngine(config.roles.trainer.engine, config.policy_path)
        self.adapter = adapter_offer(self.engine.lora, config.run.staleness)
        self.group = group
        self.seed = 0

    def step(self) -> None:
        """New adapter weights, far enough from the last to tell them apart."""
        self.seed += 1
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for p in self.engine.model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=generator) * 0.3)

    def publish(self) -> tuple[list[torch.Tensor], str]:
        snapshot = self.engine.snapshot()
        return snapshot, self.engine.checksum(snapshot)

    def send(self, snapshot: list[torch.Tensor]) -> None:
        self.engine.send(snapshot, self.group.broadcast)

    def logprobs(self, prompt: list[int], response: list[int], *, adapter: bool = True) -> np.ndarray:
        """The trainer's model's log-probabilities of `response` (a Hugging Face
        + PEFT forward; `adapter` False: the base)."""
        model = self.engine.model
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            if adapter:
                logits = model(input_ids=ids).logits[0]
            else:
                with model.disable_adapter():
                    logits = model(input_ids=ids).logits[0]
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
                                               lora_id=engine._lora_id(1))
    # The rollout reports the checksum of what it received: the trainer's.
    assert engine.checksum == sent and sent.startswith("crc32:")
    worst, off_base = 0.0, 0.0
    for ids, lps, versions in sampled(output):
        assert [s.version for s in versions] == ["1"]
        worst = max(worst, float(np.abs(lps - trainer.logprobs(prompt, ids)).max()))
        off_base = max(off_base, float(np.abs(lps - trainer.logprobs(prompt, ids, adapter=False)).max()))
    assert worst < 2e-3, f"vLLM under the received adapter disagrees with HF + PEFT by {worst:.4f} nats"
    assert off_base > 0.1, "the adapter changed nothing"
