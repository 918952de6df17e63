"""The torch trainer with LoRA on a tiny model: only the adapter trains and
leaves, the KL reference is the base with the adapter off, checkpoints are
PEFT's format (and a merged model on request), and a resume restores the
adapter and its optimizer; on one rank and on two (FSDP2)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from models import tiny_model
from ranks import run_ranks
from test_trainer import fixed_batch, objective

from rlflow import config as C
from rlflow.config import Lora, TorchTrainer
from rlflow.protocol import Codec, samples
from rlflow.services.trainer.packing import pack
from rlflow.services.trainer.torch_engine import TorchEngine
from rlflow.services.weights import tensors_checksum

LORA = Lora(rank=8, alpha=16)
CFG = TorchTrainer(lr=1e-2, lora=LORA)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("lora-trainer") / "model", tied=False, seed=5)


def base_logprobs(model_path, prompt, response) -> np.ndarray:
    """The base model as transformers loads it from disk."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
    n = len(prompt)
    return logp[torch.arange(n - 1, n - 1 + len(response)), torch.tensor(np.asarray(response, np.int64))].numpy()


def test_only_the_adapter_trains_and_only_it_leaves(model_path):
    engine = TorchEngine(CFG, str(model_path))
    full = TorchEngine(TorchTrainer(), str(model_path))
    batch = fixed_batch(engine)
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    optimized = [p for g in engine.optimizer.param_groups for p in g["params"]]
    assert all(p.requires_grad for p in optimized) and len(optimized) == len(engine.specs)
    # Rank 8 on q, k, v, o, gate, up, down of 2 layers: A (8 x in) and B (out x 8) each.
    assert sum(p.numel() for p in optimized) == 2 * 8 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 512) * 3)
    assert engine.specs[0].name == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert engine.nbytes < full.nbytes / 4
    before = objective(engine, batch)
    for _ in range(3):
        engine.train(batch)
    assert objective(engine, batch) > before + 0.05
    assert all(torch.equal(frozen[n], p) for n, p in engine.model.named_parameters() if n in frozen)
    # The snapshot is what the layout says, and its checksum changes with it.
    snapshot = engine.snapshot()
    assert [list(t.shape) for t in snapshot] == [s.shape for s in engine.specs]
    first = engine.checksum(snapshot)
    engine.train(batch)
    assert first.startswith("crc32:") and engine.checksum(engine.snapshot()) != first


@pytest.mark.parametrize("kl_in", ["loss", "reward"])
def test_the_kl_reference_is_the_base_with_the_adapter_off(model_path, kl_in):
    """No teacher and no second model: the trainer scores the base itself."""
    cfg = msgspec.structs.replace(CFG, kl_coef=0.5, kl_in=kl_in)
    engine = TorchEngine(cfg, str(model_path))
    batch = fixed_batch(engine)  # no teacher log-probabilities in it
    first = engine.train(batch)
    engine.train(batch)
    row = next(iter(samples(batch)))
    reference = engine.weights.base_logprobs(pack([row])).numpy()
    np.testing.assert_allclose(reference, base_logprobs(model_path, row.prompt_ids, row.response_ids), atol=1e-5)
    if kl_in == "loss":
        # At the first step the adapter is zero: the policy is the base, KL 0; later it has moved.
        assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6) and engine.train(batch)["kl_loss"] > 1e-4
    else:
        # The behaviour policy's distance from the base: 0 for samples of the base, more once it has moved.
        assert first["kl_penalty_mean"] == pytest.approx(0.0, abs=1e-6)
        assert engine.prepare(fixed_batch(engine), 1)[0]["kl_penalty_mean"] > 1e-4


def test_a_kl_penalty_needs_a_teacher_only_for_another_reference():
    base = {
        "pools": {"p": {}},
        "roles": {"rollout": {"pool": "p"}, "reward": {"pool": "p"}, "trainer": {"pool": "p", "replicas": 1, "engine": {
            "kind": "torch", "kl_coef": 0.1, "kl_in": "loss", "lora": {"reference": "base"}}}},
    }
    C.build(base)
    with pytest.raises(C.ConfigError, match=r"roles.trainer.engine.kl_coef = 0.1: reads the column teacher_logprobs, "
                                            r"which no role of this config attaches \(\[roles.teacher\] does"):
        C.build(base, {"roles": {"trainer": {"engine": {"lora": {"reference": "teacher"}}}}})
    with pytest.raises(C.ConfigError, match="roles.trainer.engine.kl_in = 'reward': with lora.reference = 'base' "
                                            "and several trainer ranks"):
        C.build(base, {"roles": {"trainer": {"replicas": 2, "engine": {"kl_in": "reward"}}}})


def test_a_checkpoint_is_the_adapter_in_peft_format_and_the_merged_model_on_request(model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = TorchEngine(msgspec.structs.replace(CFG, lora=msgspec.structs.replace(LORA, save_merged=True)),
                         str(model_path))
    batch = fixed_batch(engine)
    engine.train(batch)
    folder = tmp_path / "step-000001"
    engine.save(folder, {"step": 1, "version": 1})
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    engine.model.eval()
    with torch.no_grad():
        expected = engine.model(input_ids=ids).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), str(folder / "adapter"))
        torch.testing.assert_close(peft.eval()(input_ids=ids).logits, expected, rtol=0, atol=0)
        merged = AutoModelForCausalLM.from_pretrained(folder).eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=0, atol=1e-4)
    assert (folder / "adapter" / "adapter_config.json").exists() and (folder / "tokenizer.json").exists()


def test_resume_restores_the_adapter_and_its_optimizer(model_path, tmp_path):
    engine = TorchEngine(CFG, str(model_path))
    batch = fixed_batch(engine)
    engine.train(batch)
    folder = tmp_path / "step-000001"
    engine.save(folder, {"step": 1, "version": 1})
    saved = [s["exp_avg_sq"].clone() for s in engine.optimizer.state.values()]
    after_save = engine.train(batch)

    resumed = TorchEngine(CFG, str(model_path), adapter=str(folder / "adapter"))
    assert resumed.load_state(folder) == {"step": 1, "version": 1} and resumed.steps == 1
    moments = [s["exp_avg_sq"] for s in resumed.optimizer.state.values()]
    assert len(moments) == len(resumed.specs) and any(m.abs().max() > 0 for m in moments)
    for a, b in zip(moments, saved):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    again = resumed.train(batch)
    assert again["loss"] == pytest.approx(after_save["loss"], rel=1e-5)
    for a, b in zip(engine.snapshot(), resumed.snapshot()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kl_coef", [0.0, 0.5], ids=["rl", "kl-to-base"])
def test_a_lora_step_on_two_ranks_is_the_step_on_one(model_path, tmp_path, kl_coef):
    """FSDP2 over a frozen base: the same adapter after a step, rank 0's
    checksum of it, and a checkpoint one rank resumes. With a KL penalty to
    the base, 7 samples: one rank takes an idle pass, whose base forward
    pairs with the other's."""
    from rlflow.protocol import take

    cfg = msgspec.structs.replace(CFG, lr=1e-3, micro_batch_tokens=12, kl_coef=kl_coef)
    batch = fixed_batch(TorchEngine(cfg, str(model_path)))
    frames = [bytes(f) for f in Codec().encode(take(batch, list(range(7))) if kl_coef else batch)]
    solo = TorchEngine(cfg, str(model_path))
    solo.train(Codec().decode(frames))
    expected = [t.numpy() for t in solo.snapshot()]
    two = run_ranks("lora_step_and_checkpoint", 2, cfg, model_path, frames, tmp_path / "step-000001")
    one = run_ranks("lora_resume_and_step", 1, cfg, model_path, frames, tmp_path / "step-000001")[0]
    assert two[1]["adapter"] is None and two[1]["checksum"] == ""  # rank 1 keeps nothing: rank 0 sends
    # Rank 0's checksum is of the adapter it holds whole (sums in another order: not bit-equal to one rank's).
    assert two[0]["checksum"] == tensors_checksum(solo.specs, [torch.from_numpy(a) for a in two[0]["adapter"]])
    for got, want in zip(two[0]["adapter"], expected):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    for got, want in zip(one["resumed"], expected):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    solo.train(Codec().decode(frames))
    for got, want in zip(one["after"], solo.snapshot()):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=0)
