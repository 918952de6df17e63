"""The torch trainer on a tiny model: learning on a fixed batch, checkpoints."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch
from models import tiny_model

from rlflow.config import Lora, TorchTrainer
from rlflow.protocol import FinishReason, PromptGroup, Response, Tensor, build_batch, samples
from rlflow.services.trainer.torch_engine import TorchEngine, learning_rate


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("trainer") / "model", tied=False, seed=5)


def fixed_batch(engine: TorchEngine, seed: int = 0):
    """Two groups of four sampled responses, with their behaviour log-probs
    under the engine's weights and mixed rewards."""
    rng = np.random.default_rng(seed)
    groups, rewards = [], []
    for g in range(2):
        prompt = [int(x) for x in rng.integers(3, 17, 5)]
        responses = []
        for i in range(4):
            ids = rng.integers(3, 17, 6).astype(np.int32)
            with torch.no_grad():
                logits = engine.model(input_ids=torch.tensor([prompt + ids.tolist()])).logits[0]
            logp = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1, len(prompt) + 5), torch.tensor(ids)]
            responses.append(Response(ids, logp.numpy().astype(np.float32), np.zeros(6, np.int32), FinishReason.STOP))
            rewards.append(float(i % 2))
        groups.append((PromptGroup(group_id=g, prompt_ids=prompt, n=4), responses))
    batch = build_batch(groups)
    return msgspec.structs.replace(batch, rewards=Tensor.of(rewards, "float32"))


def objective(engine: TorchEngine, batch) -> float:
    """Token mean of advantage x log-probability: what the policy gradient raises."""
    from rlflow.algo.losses import group_advantages
    from rlflow.protocol import samples

    rows = list(samples(batch))
    adv = group_advantages(torch.tensor([r.reward for r in rows]), torch.tensor([r.group.group_id for r in rows]))
    total, count = 0.0, 0
    with torch.no_grad():
        for a, r in zip(adv, rows):
            ids = torch.tensor([np.concatenate([r.prompt_ids, r.response_ids]).tolist()])
            logp = torch.log_softmax(engine.model(input_ids=ids).logits[0], -1)
            n = len(r.prompt_ids)
            picked = logp[torch.arange(n - 1, n - 1 + len(r.response_ids)),
                          torch.tensor(r.response_ids.astype(np.int64))]
            total += float(a) * picked.sum().item()
            count += len(r.response_ids)
    return total / count


def test_the_objective_rises_on_a_fixed_batch(model_path):
    # Decoupled: each step clips around the weights it starts from, so the same batch keeps teaching (clipped
    # around the behaviour policy, a batch trained on five times stops moving the policy past the clip).
    engine = TorchEngine(TorchTrainer(lr=3e-3, decoupled=True), str(model_path))
    batch = fixed_batch(engine)
    values = [objective(engine, batch)]
    for _ in range(5):
        metrics = engine.train(batch)
        values.append(objective(engine, batch))
    assert values[-1] > values[0] + 0.05, values
    assert all(b > a for a, b in zip(values, values[1:])), values
    assert metrics["trained_tokens"] == 48 and metrics["mixed_sample_share"] == 1.0
    assert metrics["grad_norm"] > 0


def test_a_mixed_precision_step_is_the_float32_step_to_bf16_accuracy(model_path):
    """bf16 passes over float32 weights: the weights and optimizer stay
    float32, and the step's loss and gradient are the float32 step's within
    what bf16 rounding moves them (and not equal: the passes did run in bf16)."""
    out, after = {}, {}
    for mixed in (False, True):
        engine = TorchEngine(TorchTrainer(lr=3e-3, mixed_precision=mixed, grad_clip=1e6), str(model_path))
        batch = fixed_batch(engine)
        out[mixed] = engine.train(batch)
        after[mixed] = [p.detach().clone() for p in engine.model.parameters()]
        assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    assert out[True]["loss"] == pytest.approx(out[False]["loss"], rel=0.05, abs=1e-3)
    assert out[True]["grad_norm"] == pytest.approx(out[False]["grad_norm"], rel=0.05)
    assert out[True]["grad_norm"] != out[False]["grad_norm"]
    # Adam's first step moves each weight by about lr either way: bf16 flips the sign of few.
    moved = torch.cat([(a - b).abs().flatten() for a, b in zip(after[True], after[False])])
    assert 0 < float(moved.mean()) < 0.1 * 3e-3, float(moved.mean())


def test_groups_without_signal_are_left_out(model_path):
    engine = TorchEngine(TorchTrainer(lr=3e-3), str(model_path))
    batch = fixed_batch(engine)
    uniform = msgspec.structs.replace(batch, rewards=Tensor.of([1.0] * 8, "float32"))
    before = [p.detach().clone() for p in engine.model.parameters()]
    metrics = engine.train(uniform)
    assert metrics["trained_tokens"] == 0 and metrics["mixed_sample_share"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))


def test_the_loss_normaliser_counts_the_tokens_of_groups_without_signal(model_path):
    """One group with signal, one without, each 4 samples of 6 tokens: over
    the batch's tokens (or its samples) the gradient is half what it is over
    the tokens trained on."""
    batch = fixed_batch(TorchEngine(TorchTrainer(), str(model_path)))
    half = msgspec.structs.replace(batch, rewards=Tensor.of([0.0, 1.0, 0.0, 1.0] + [1.0] * 4, "float32"))
    out = {}
    for norm in ("trained_tokens", "batch_tokens", "sequences"):
        engine = TorchEngine(TorchTrainer(loss_norm=norm, grad_clip=1e6), str(model_path))
        out[norm] = engine.train(half)
        assert out[norm]["trained_tokens"] == 24 and out[norm]["mixed_sample_share"] == 0.5
        assert out[norm]["uniform_high_share"] == 0.5 and out[norm]["uniform_low_share"] == 0.0
    assert out["trained_tokens"]["grad_norm"] > 1.0
    for norm in ("batch_tokens", "sequences"):
        assert out[norm]["grad_norm"] == pytest.approx(0.5 * out["trained_tokens"]["grad_norm"], rel=1e-4)


def test_learning_rate_schedules_by_hand(model_path):
    linear = TorchTrainer(lr=1e-3, warmup_steps=2, lr_decay="linear", lr_final=0.1)
    # Warm-up 1/2, 2/2; then from 1e-3 at step 2 down to 1e-4 at step 11, the last of 12.
    got = [learning_rate(linear, step, 12) for step in (0, 1, 2, 6, 11)]
    assert got == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3 * (0.1 + 0.9 * 5 / 9), 1e-4])
    cosine = TorchTrainer(lr=1e-3, lr_decay="cosine")
    assert [learning_rate(cosine, step, 5) for step in (0, 1, 2, 4)] == pytest.approx(
        [1e-3, 1e-3 * (1 + math.cos(math.pi / 4)) / 2, 5e-4, 0.0])
    assert learning_rate(TorchTrainer(lr=1e-3), 50, 12) == 1e-3
    # A run cut short of its schedule: the decay spans lr_decay_steps, not the run's steps.
    spread = TorchTrainer(lr=1e-3, lr_decay="cosine", lr_decay_steps=9)
    engine = TorchEngine(spread, str(model_path), total_steps=3)
    assert engine.total_steps == 9 and learning_rate(spread, 4, engine.total_steps) == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="lr_decay = 'linear' needs the run's step count"):
        TorchEngine(linear, "/unused")


def test_a_sample_without_a_reward_is_refused(model_path):
    engine = TorchEngine(TorchTrainer(), str(model_path))
    batch = fixed_batch(engine)
    with pytest.raises(ValueError, match="without a reward"):
        engine.train(msgspec.structs.replace(batch, rewards=Tensor.of([np.nan] + [1.0] * 7, "float32")))


def lengths_batch(lengths: list[int], finish: list[FinishReason]):
    """One group of samples of these response lengths, every reward 1 (no signal)."""
    responses = [Response(np.full(n, 5, np.int32), np.full(n, -1.0, np.float32), np.zeros(n, np.int32), f)
                 for n, f in zip(lengths, finish)]
    batch = build_batch([(PromptGroup(group_id=0, prompt_ids=[3, 4], n=len(lengths)), responses)])
    return msgspec.structs.replace(batch, rewards=Tensor.of([1.0] * len(lengths), "float32"))


def test_overlong_shaping_and_filtering_by_hand(model_path):
    stop, cut = FinishReason.STOP, FinishReason.LENGTH
    batch = lengths_batch([2, 4, 6, 8], [stop, stop, stop, cut])
    assert TorchEngine(TorchTrainer(), str(model_path)).prepare(batch, 1)[0]["mixed_sample_share"] == 0.0
    # max_tokens 8, a buffer of 4: penalties 0, 0, (6 - 4) / 4 = 0.5 and 1: rewards 1, 1, 0.5, 0 now differ.
    shaped = TorchEngine(TorchTrainer(overlong_buffer=4), str(model_path), max_tokens=8)
    stats, (share,) = shaped.prepare(batch, 1)
    assert stats["overlong_penalty_mean"] == pytest.approx(0.375)
    assert stats["mixed_sample_share"] == 1.0 and stats["trained_tokens"] == 20
    assert share.advantages.numpy()[0] > share.advantages.numpy()[2] > share.advantages.numpy()[3]
    # Filtered: the sample the length cap cut is not trained on; the others' advantages are still
    # computed with it in the group (scaled by the batch_tokens normaliser: 12 tokens of 20 trained, not 20).
    filtered = TorchEngine(TorchTrainer(overlong_buffer=4, overlong_filter=True), str(model_path), max_tokens=8)
    stats, (kept,) = filtered.prepare(batch, 1)
    assert stats["trained_tokens"] == 12 and stats["overlong_filtered_share"] == 0.25
    assert kept.advantages.numpy().tolist() == pytest.approx((share.advantages.numpy()[:3] * 12 / 20).tolist())
    with pytest.raises(ValueError, match="needs the rollout's max_tokens"):
        TorchEngine(TorchTrainer(overlong_buffer=4), str(model_path))


def test_a_step_reports_the_gap_and_what_its_correction_did(model_path):
    """The behaviour log-probabilities of `fixed_batch` are the trainer's own
    (to float32 rounding): no gap; shifted by log 3 on every token, each
    token's weight is 3: truncated at 2, or masked above 2."""
    engine = TorchEngine(TorchTrainer(), str(model_path))
    batch = fixed_batch(engine)
    own = engine.train(batch)
    assert own["gap_max"] < 1e-4 and own["gap_p99"] <= own["gap_max"]
    assert own["seq_weight_min"] == pytest.approx(1.0, abs=1e-4)
    shifted = msgspec.structs.replace(batch, logprobs=Tensor.from_numpy(batch.logprobs.numpy() - math.log(3)))
    for correction, share in (("truncate", "truncated_share"), ("mask", "masked_share")):
        cfg = TorchTrainer(decoupled=True, correction=correction, correction_high=2.0)
        stats = TorchEngine(cfg, str(model_path)).train(shifted)
        assert stats["gap_mean"] == pytest.approx(math.log(3), rel=1e-3)
        assert stats["seq_weight_max"] == pytest.approx(3.0, rel=1e-3)
        assert stats[share] == 1.0
        assert stats["behaviour_weight_mean"] == pytest.approx(2.0 if correction == "truncate" else 0.0, rel=1e-5)


def test_micro_batches_respect_the_token_budget(model_path):
    engine = TorchEngine(TorchTrainer(micro_batch_tokens=24, share_prompts=False), str(model_path))
    batch = fixed_batch(engine)
    big = TorchEngine(TorchTrainer(micro_batch_tokens=4096, share_prompts=False), str(model_path))
    small_metrics = engine.train(batch)
    big_metrics = big.train(batch)
    # 8 samples of 11 tokens: two per micro-batch of at most 24 tokens.
    assert small_metrics["micro_batches"] == 4 and big_metrics["micro_batches"] == 1
    # Accumulating over micro-batches gives the same step.
    for a, b in zip(engine.model.parameters(), big.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    # Shared prompts: a group's prompt (5 tokens) once and three responses of 6 fill a row of 23,
    # the fourth goes in a row of 11 with the prompt again; the two rows of 11 share a pass.
    shared = TorchEngine(TorchTrainer(micro_batch_tokens=24), str(model_path))
    assert shared.train(batch)["micro_batches"] == 3


def test_a_response_shares_its_prompts_row_where_that_costs_less():
    """Short answers to a long prompt share one row; long answers to a short prompt (attention over
    a long row costing more than the prompt saved) keep one each; no row past the budget. The cost
    by the model's shape: Qwen2.5-0.5B's (d 896, 14 heads of 64, 2 key-value heads, MLP 4,864, 24
    layers, 151,936 tokens) attends over 11,485 tokens for what its linear layers cost a token."""
    from transformers import Qwen2Config

    from rlflow.services.trainer.packing import attention_weight, prompt_units

    weight = attention_weight(Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                          intermediate_size=4864, num_hidden_layers=24, vocab_size=151936))
    linear = 2 * (2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864) + 2 * 896 * 151936 / 24
    assert weight == pytest.approx(4 * 896 / linear) and 1 / weight == pytest.approx(11485, abs=1)

    def rows(prompt: int, answers: list[int], budget: int = 8192) -> list[list[int]]:
        responses = [Response(np.ones(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32),
                              FinishReason.STOP) for n in answers]
        batch = build_batch([(PromptGroup(group_id=0, prompt_ids=[1] * prompt, n=len(answers)), responses)])
        return prompt_units(list(samples(batch)), budget, weight)

    assert rows(300, [20] * 8) == [list(range(8))]
    assert rows(20, [3000] * 4) == [[0], [1], [2], [3]]
    assert rows(300, [20] * 8, budget=350) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def gradient(engine: TorchEngine, batch) -> list[torch.Tensor]:
    """The gradient of one step on `batch` (the step's optimizer update held back)."""
    engine.optimizer.step = lambda: None
    engine.optimizer.zero_grad = lambda set_to_none=True: None
    engine.train(batch)
    return [p.grad.clone() for p in engine.model.parameters() if p.requires_grad]


@pytest.mark.parametrize("settings", [{}, {"objective": "gspo"},
                                      {"lora": Lora(rank=4, alpha=8, reference="base"), "kl_coef": 0.5}],
                         ids=["ppo", "gspo", "lora-kl-to-base"])
def test_shared_prompts_give_the_gradient_of_a_row_per_sample(model_path, settings):
    """Each group's prompt through the model once, its responses (of different lengths, some
    tokens observations outside the loss) behind a block mask: the gradient of a row per sample,
    to float32 rounding, across micro-batches that split a group (with LoRA, the KL penalty's
    reference, the base, read from the same shared rows)."""
    rng = np.random.default_rng(3)
    groups, rewards = [], []
    for g in range(3):
        prompt = [int(x) for x in rng.integers(3, 17, int(rng.integers(3, 9)))]
        responses = []
        for i in range(4):
            n = int(rng.integers(1, 9))
            observed = (rng.random(n) < 0.8).astype(np.uint8)
            observed[0] = 1
            responses.append(Response(rng.integers(3, 17, n).astype(np.int32), np.full(n, -2.5, np.float32),
                                      np.zeros(n, np.int32), FinishReason.STOP, loss_mask=observed))
            rewards.append(float(rng.integers(0, 2)))
        groups.append((PromptGroup(group_id=g, prompt_ids=prompt, n=4), responses))
    batch = msgspec.structs.replace(build_batch(groups), rewards=Tensor.of(rewards, "float32"))
    grads, rows = {}, {}
    for share, budget in [(False, 4096), (True, 4096), (True, 20)]:
        engine = TorchEngine(TorchTrainer(share_prompts=share, micro_batch_tokens=budget, **settings), str(model_path))
        rows[share, budget] = [len(unit) for unit in engine._units(list(samples(batch)))]
        grads[share, budget] = gradient(engine, batch)
    # A row per sample; a row per group; some group split over rows, some row still shared.
    assert rows[False, 4096] == [1] * 12 and rows[True, 4096] == [4, 4, 4], rows
    assert len(rows[True, 20]) > 3 and max(rows[True, 20]) > 1, rows
    reference = grads[False, 4096]
    assert max(float(g.abs().max()) for g in reference) > 1e-3
    for key, got in grads.items():
        for a, b in zip(got, reference):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-4, msg=lambda m: f"{key}: {m}")


def test_a_checkpoint_round_trips_weights_optimizer_and_rng(model_path, tmp_path):
    engine = TorchEngine(TorchTrainer(lr=3e-3), str(model_path))
    batch = fixed_batch(engine)
    engine.train(batch)
    folder = tmp_path / "step-000001"
    engine.save(folder, {"step": 1, "version": 1})
    after_save = engine.train(batch)

    resumed = TorchEngine(TorchTrainer(lr=3e-3), str(folder))
    assert resumed.load_state(folder) == {"step": 1, "version": 1}
    assert resumed.steps == 1
    again = resumed.train(batch)
    assert again["loss"] == pytest.approx(after_save["loss"], rel=1e-5)
    for a, b in zip(engine.model.parameters(), resumed.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()


def test_a_checkpoint_from_before_sharding_still_resumes(model_path, tmp_path):
    """Its optimizer state lies whole in trainer_state.pt, keyed by parameter index."""
    import shutil

    from rlflow.rundir import TRAINER_OPTIMIZER, TRAINER_STATE

    engine = TorchEngine(TorchTrainer(lr=3e-3), str(model_path))
    batch = fixed_batch(engine)
    engine.train(batch)
    folder = tmp_path / "step-000001"
    engine.save(folder, {"step": 1, "version": 1})
    shutil.rmtree(folder / TRAINER_OPTIMIZER)
    state = torch.load(folder / TRAINER_STATE, weights_only=False)
    torch.save({**state, "optimizer": engine.optimizer.state_dict()}, folder / TRAINER_STATE)
    after_save = engine.train(batch)

    resumed = TorchEngine(TorchTrainer(lr=3e-3), str(folder))
    resumed.load_state(folder)
    assert resumed.train(batch)["loss"] == pytest.approx(after_save["loss"], rel=1e-5)
    for a, b in zip(engine.model.parameters(), resumed.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


async def test_a_version_whose_broadcast_broke_is_sent_whole_through_the_next_generation(model_path):
    """A receiver that dies as the trainer broadcasts version 1 breaks the
    group; the controller then moves the same version through a new
    generation, and the trainer still has it to send: it arrives whole."""
    import threading

    import trio

    from rlflow import config as C
    from rlflow.services.base import standalone_context
    from rlflow.services.trainer.torch_trainer import TorchTrainerEngine
    from rlflow.services.weights import GlooGroup, receive_pieces

    config = C.build({
        "pools": {"p": {}},
        "roles": {"rollout": {"pool": "p", "model": str(model_path)}, "reward": {"pool": "p"},
                  "trainer": {"pool": "p", "engine": {"kind": "torch"}}},
        "cluster": {"handshake_timeout_s": 20, "weight_timeout_s": 20},
    })
    serving = TorchTrainerEngine(config.roles.trainer.engine, standalone_context(config, "trainer"))
    offer, specs = serving.offer()

    def join(transfer, receive: bool, box: dict) -> None:
        group = GlooGroup(transfer.host, transfer.port, 1, 2, 20)
        if receive:
            box.update({name: t.clone() for name, t in receive_pieces(
                lambda piece: group.broadcast(piece, 0), specs, transfer.nbytes, transfer.bucket_bytes)})
        group.close()  # dies before the broadcast: the trainer's breaks

    try:
        with trio.fail_after(120):
            first = msgspec.structs.replace(offer, world_size=2)
            dying = threading.Thread(target=join, args=(first, False, {}), daemon=True)
            dying.start()
            await serving.connect(first)
            dying.join(20)
            await serving.publish(1)
            with pytest.raises(Exception):
                await serving.send(1, None)
            second = serving.new_group(msgspec.structs.replace(first, generation=1))
            received: dict = {}
            receiver = threading.Thread(target=join, args=(second, True, received), daemon=True)
            receiver.start()
            await serving.send(1, second)
            receiver.join(20)
    finally:
        await serving.close()
    weights = dict(serving.engine.model.named_parameters())
    assert set(received) == {s.name for s in specs}, set(received) ^ {s.name for s in specs}
    whole = {name: getattr(w, "full_tensor", lambda w=w: w)().detach() for name, w in weights.items()}
    assert all(torch.equal(received[name], whole[name]) for name in received)


def test_the_report_names_a_gap_that_grows_and_the_status_and_curves_carry_it():
    from rlflow.control.stats import TRENDS
    from rlflow.roles import BY_NAME
    from rlflow.rundir import StepRow
    from rlflow.services.trainer.report import line
    from rlflow.tools.report import role_lines

    def rows(p99s: list[float]) -> list[StepRow]:
        return [StepRow(step=i, version=i + 1, time_s=float(i),
                        train={"gap_p99": p, "gap_mean": p / 10, "gap_max": 2 * p, "masked_share": 0.0})
                for i, p in enumerate(p99s)]

    steady = rows([0.1] * 20)
    assert line(steady) == ("engine-trainer gap |log p_train - log p_rollout| per token: p99 0.1 over the first 10 "
                            "steps, 0.1 over the last 10; largest 0.2")
    grows = rows([0.05] * 10 + [0.2] * 10)
    assert line(grows).endswith("The gap grows (4.0x): the rollout and the trainer drift apart; see the "
                                "corrections in docs/training.md")
    assert not line(rows([1e-6] * 10 + [1e-5] * 10)).count("grows")  # tenfold, but float32 rounding
    assert line([StepRow(step=0, version=1, time_s=0.0)]) == ""
    assert role_lines(grows) == [line(grows)]  # the report reaches it through the registry
    assert {"gap_p99", "gap_mean"} <= set(TRENDS) and BY_NAME["trainer"].curves_title
