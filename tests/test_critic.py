"""The critic: GAE against sums worked by hand, the clipped value loss, a
value model that learns a value that is known, one rank equal to two, a
checkpoint that resumes, per-token advantages through the trainer's loss,
the config's checks, and the planner and report that model and name it."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch
from models import tiny_model
from ranks import run_ranks

from rlflow import config as C
from rlflow.algo.values import (
    centre_by_returns, explained_variance, gae, token_rewards, value_loss, whiten,
)
from rlflow.protocol import Codec, FinishReason, PromptGroup, Response, Tensor, build_batch, samples
from rlflow.services.critic.config import TorchCritic
from rlflow.services.critic.stats import of_batch

# -- GAE, by hand ------------------------------------------------------------------------------


def test_gae_with_the_reward_at_the_last_token_only():
    rewards = token_rewards(1.0, 3)
    assert rewards.tolist() == [0.0, 0.0, 1.0]
    values = np.array([0.5, 0.25, 0.75])
    gamma, lam = 0.9, 0.8
    # delta_t = r_t + gamma V_{t+1} - V_t, with V_3 = 0:
    d2 = 1.0 + 0.0 - 0.75                 # 0.25
    d1 = 0.0 + 0.9 * 0.75 - 0.25          # 0.425
    d0 = 0.0 + 0.9 * 0.25 - 0.5           # -0.275
    a2 = d2
    a1 = d1 + 0.9 * 0.8 * a2
    a0 = d0 + 0.9 * 0.8 * a1
    advantages, returns = gae(rewards, values, gamma, lam)
    np.testing.assert_allclose(advantages, [a0, a1, a2], atol=1e-12)
    np.testing.assert_allclose(returns, [a0 + 0.5, a1 + 0.25, a2 + 0.75], atol=1e-12)


def test_gae_lambda_zero_is_the_one_step_td_error_and_one_the_return_minus_the_value():
    rewards = np.array([0.0, -0.5, 0.0, 2.0])
    values = np.array([0.3, -0.2, 1.0, 0.4])
    gamma = 0.95
    td, _ = gae(rewards, values, gamma, 0.0)
    following = np.append(values[1:], 0.0)
    np.testing.assert_allclose(td, rewards + gamma * following - values, atol=1e-12)
    mc, returns = gae(rewards, values, gamma, 1.0)
    discounted = [sum(gamma ** (k - t) * rewards[k] for k in range(t, 4)) for t in range(4)]
    np.testing.assert_allclose(mc, np.array(discounted) - values, atol=1e-12)
    np.testing.assert_allclose(returns, discounted, atol=1e-12)  # lam 1: the return is the discounted reward


def test_gae_of_gamma_and_lambda_one_with_zero_values_is_the_reward_at_every_token():
    advantages, returns = gae(token_rewards(0.75, 5), np.zeros(5), 1.0, 1.0)
    assert advantages.tolist() == [0.75] * 5 and returns.tolist() == [0.75] * 5
    assert gae(np.zeros(0), np.zeros(0), 1.0, 0.95)[0].size == 0
    with pytest.raises(ValueError, match="one of each per token"):
        gae(np.zeros(3), np.zeros(2), 1.0, 1.0)


def test_a_kl_penalty_in_the_reward_falls_on_every_token():
    penalty = np.array([0.1, 0.2, 0.3])
    assert token_rewards(1.0, 3, penalty).tolist() == pytest.approx([-0.1, -0.2, 0.7])


def test_the_clipped_value_loss_by_hand():
    new = torch.tensor([1.0, 0.0, 0.5], requires_grad=True)
    old = torch.tensor([0.0, 0.0, 0.4])
    returns = torch.tensor([2.0, 1.0, 0.0])
    loss, clipped = value_loss(new, old, returns, clip=0.2)
    # token 0: plain (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24; token 1: both 1;
    # token 2: plain 0.25, clipped (0.5-0)^2 = 0.25
    assert float(loss.detach()) == pytest.approx(0.5 * (3.24 + 1.0 + 0.25))
    assert int(clipped) == 1
    loss.backward()
    assert new.grad.tolist() == pytest.approx([0.0, -1.0, 0.5])  # the clipped token pulls no further
    plain, none = value_loss(new.detach(), old, returns, clip=0.0)
    assert float(plain) == pytest.approx(0.5 * (1.0 + 1.0 + 0.25)) and int(none) == 0


def test_whitening_and_explained_variance():
    x = whiten(np.array([1.0, 2.0, 3.0, 6.0]))
    assert x.mean() == pytest.approx(0.0, abs=1e-12) and x.std() == pytest.approx(1.0, abs=1e-6)
    assert whiten(np.array([2.0, 2.0])).tolist() == [0.0, 0.0]
    # Centred, over the spread of the returns: small residuals stay small, and returns that all agree
    # (nothing to learn) give 0 however the values erred.
    advantages, returns = np.array([0.1, -0.1, 0.05, -0.05]), np.array([1.0, 0.0, 1.0, 0.0])
    np.testing.assert_allclose(centre_by_returns(advantages, returns), advantages / 0.5)
    assert np.abs(whiten(advantages)).max() > 1.0
    assert centre_by_returns(np.array([0.3, -0.2]), np.ones(2)).tolist() == [0.0, 0.0]
    returns = np.array([0.0, 1.0, 0.0, 1.0])
    assert explained_variance(returns, returns) == 1.0
    assert explained_variance(np.full(4, 0.5), returns) == 0.0
    assert math.isnan(explained_variance(np.zeros(2), np.ones(2)))


def _batch(lengths=((3, 2), (4,)), rewards=(1.0, 0.0, 1.0), prompt=(3, 4, 5)):
    items, k = [], 0
    for g, group in enumerate(lengths):
        responses = []
        for t in group:
            ids = (np.arange(t) % 12 + 3).astype(np.int32)
            responses.append(Response(ids, np.full(t, -0.5, np.float32), np.zeros(t, np.int32), FinishReason.STOP))
            k += 1
        items.append((PromptGroup(group_id=g, prompt_ids=list(prompt), n=len(group)), responses))
    return msgspec.structs.replace(build_batch(items), rewards=Tensor.of(list(rewards), "float32"))


def test_critic_statistics_of_a_trainer_step():
    batch = _batch()
    values = np.array([0.5, 0.5, 0.5, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], np.float32)
    returns = np.array([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], np.float32)
    batch = msgspec.structs.replace(batch, values=Tensor.from_numpy(values), returns=Tensor.from_numpy(returns),
                                    critic_versions=Tensor.of([4, 4, 6], "int32"))
    stats = of_batch(batch, step=6)
    assert stats["critic_value_loss"] == pytest.approx(0.5 * 3 * 0.25 / 9)
    assert stats["critic_explained_var"] == pytest.approx(explained_variance(values, returns))
    assert stats["critic_staleness_mean"] == pytest.approx(4 / 3) and stats["critic_staleness_max"] == 2
    assert of_batch(_batch(), step=1) == {}


# -- the value model ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("critic") / "model", tied=False, seed=3)


def with_targets(batch, values: np.ndarray, gamma: float = 1.0, lam: float = 1.0):
    """`batch` with `values` and the GAE returns and advantages they give."""
    offsets = batch.response_offsets.numpy()
    adv, ret = np.zeros_like(values), np.zeros_like(values)
    for row in samples(batch):
        a, b = offsets[row.row], offsets[row.row + 1]
        adv[a:b], ret[a:b] = gae(token_rewards(row.reward, b - a), values[a:b], gamma, lam)
    return msgspec.structs.replace(batch, values=Tensor.from_numpy(values.astype(np.float32)),
                                   returns=Tensor.from_numpy(ret.astype(np.float32)),
                                   token_advantages=Tensor.from_numpy(adv.astype(np.float32)))


def arith_batch(tokenizer, rng: np.random.Generator, size: int, p_right: dict[int, float], first: int = 0):
    """`size` problems of 1 to 3 digits, each answered with its worked solution
    and rewarded 1 with a chance that depends on its digits alone."""
    from rlflow.tasks.arith import Arith

    items, rewards, digits = [], [], []
    for g in range(size):
        d = int(rng.integers(1, 4))
        a, b = int(rng.integers(10 ** (d - 1) if d > 1 else 0, 10 ** d)), int(rng.integers(0, 10))
        prompt = tokenizer.encode(Arith.prompt_text(a, b), add_special_tokens=False)
        ids = np.asarray(tokenizer.encode(Arith.solution(a, b), add_special_tokens=False), np.int32)
        items.append((PromptGroup(group_id=first + g, prompt_ids=prompt, n=1),
                      [Response(ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int32), FinishReason.STOP)]))
        rewards.append(float(rng.random() < p_right[d]))
        digits.append(d)
    return msgspec.structs.replace(build_batch(items), rewards=Tensor.of(rewards, "float32")), np.array(digits)


def first_values(model, batch) -> np.ndarray:
    """The value at each sample's first response token."""
    values = model.values(batch)
    return values[batch.response_offsets.numpy()[:-1]]


@pytest.mark.slow
def test_the_critic_learns_that_more_digits_earn_less():
    """On arithmetic whose chance of a right answer falls with the digits (as
    the default task's does for the default model), a critic started from the
    default model and trained on the returns comes to value held-out prompts
    in the order of their digits, at the first response token."""
    from rlflow.models import resolve_model
    from rlflow.services.critic.torch_engine import CriticModel
    from rlflow.tasks.core import load_tokenizer

    path = resolve_model("default")
    tokenizer = load_tokenizer(path)
    chance = {1: 0.9, 2: 0.5, 3: 0.1}
    model = CriticModel(TorchCritic(lr=3e-4, value_clip=0.0, micro_batch_tokens=4096), str(path))
    heldout, digits = arith_batch(tokenizer, np.random.default_rng(99), 300, chance)
    before = first_values(model, heldout)
    rng = np.random.default_rng(0)
    for step in range(20):
        batch, _ = arith_batch(tokenizer, rng, 32, chance, first=32 * step)
        # gamma = lam = 1: every token's return is the sample's reward, whatever the values (unclipped).
        model.step(with_targets(batch, np.zeros(batch.n_tokens)))
    values = first_values(model, heldout)
    means = [float(values[digits == d].mean()) for d in (1, 2, 3)]
    assert means[0] > means[1] > means[2], means
    # A new head: the gap between one and three digits was learned, not there from the start.
    gap_before = float(before[digits == 1].mean() - before[digits == 3].mean())
    assert means[0] - means[2] > gap_before + 0.2, (means, gap_before)


def critic_frames(model_path) -> list[bytes]:
    """A batch with mixed rewards and lengths, as wire frames (what the ranks' processes get)."""
    from rlflow.tasks.core import load_tokenizer

    batch, _ = arith_batch(load_tokenizer(model_path), np.random.default_rng(5), 12, {1: 0.9, 2: 0.5, 3: 0.1})
    batch = with_targets(batch, np.linspace(0.0, 0.6, batch.n_tokens), gamma=0.99, lam=0.95)
    return [bytes(f) for f in Codec().encode(batch)]


CFG = TorchCritic(lr=1e-4, micro_batch_tokens=60, value_clip=0.2)


@pytest.mark.slow
def test_a_critic_step_on_two_ranks_is_the_step_on_one_and_its_checkpoint_resumes(model_path, tmp_path):
    """Values, a step, a checkpoint and a second step on 1 and on 2 ranks
    agree; the checkpoint of 2 ranks resumes on 1 with the same weights,
    Adam moments and step count, and its next step is the same again."""
    from rlflow.services.critic.torch_engine import CriticModel

    frames = critic_frames(model_path)
    batch = Codec().decode(frames)
    solo = CriticModel(CFG, str(model_path))
    first_values = solo.values(batch)
    solo_first = solo.step(batch)
    solo_second = solo.step(batch)
    solo_weights = {n: p.detach().numpy().copy() for n, p in solo.model.named_parameters()}
    for world in (1, 2):
        folder = tmp_path / f"ranks{world}" / "critic-step-000001"
        out = run_ranks("critic_values_step_checkpoint_step", world, CFG, model_path, frames, folder)[0]
        np.testing.assert_allclose(out["values"], first_values, atol=1e-5)
        for key in ("value_loss", "value_clipped_share", "grad_norm", "tokens"):
            assert out["first"][key] == pytest.approx(solo_first[key], abs=1e-5), (world, key)
            assert out["second"][key] == pytest.approx(solo_second[key], abs=1e-5), (world, key)
        for name, value in solo_weights.items():
            np.testing.assert_allclose(out["after_second"][name], value, atol=1e-5, err_msg=name)
    resumed = run_ranks("critic_resume_and_step", 1, CFG, folder, frames)[0]
    assert resumed["steps"] == 1
    for name, value in out["after_first"].items():
        np.testing.assert_allclose(resumed["resumed"][name], value, atol=1e-6, err_msg=name)
    for name, moments in out["moments"].items():
        for key, value in moments.items():
            np.testing.assert_allclose(resumed["moments"][name][key], value, atol=1e-6, err_msg=f"{name}.{key}")
    for name, value in solo_weights.items():
        np.testing.assert_allclose(resumed["after_second"][name], value, atol=1e-5, err_msg=name)


@pytest.mark.slow  # three critic steps
def test_the_critic_trains_on_an_episodes_own_tokens_alone(model_path):
    """Whatever returns an episode's observation tokens carry, a critic step moves the value
    model the same and counts the model's tokens alone; without the mask it moves it otherwise."""
    from rlflow.services.critic.torch_engine import CriticModel

    def batch(observed: float, masked: bool = True):
        mask = np.asarray([1] * 4 + [0] * 3 + [1] * 3, np.uint8)
        rng = np.random.default_rng(1)
        items = [(PromptGroup(group_id=g, prompt_ids=[3, 4, 5], n=1),
                  [Response(np.asarray(rng.integers(3, 17, 10), np.int32), np.zeros(10, np.float32),
                            np.zeros(10, np.int32), FinishReason.STOP, loss_mask=mask if masked else None)])
                 for g in range(4)]
        returns = np.tile(np.where(mask == 1, 0.5, observed), 4).astype(np.float32)
        return msgspec.structs.replace(build_batch(items), rewards=Tensor.of([0.5] * 4, "float32"),
                                       values=Tensor.from_numpy(np.zeros(40, np.float32)),
                                       returns=Tensor.from_numpy(returns),
                                       token_advantages=Tensor.from_numpy(returns))

    after, stats = [], []
    for observed, masked in ((0.0, True), (7.0, True), (7.0, False)):
        model = CriticModel(TorchCritic(lr=1e-3, micro_batch_tokens=64, value_clip=0.0), str(model_path))
        stats.append(model.step(batch(observed, masked)))
        after.append([p.detach().clone() for p in model.model.parameters()])
    assert stats[0]["tokens"] == stats[1]["tokens"] == 4 * 7 and stats[2]["tokens"] == 4 * 10
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(after[0], after[1]))
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(after[0], after[2]))


def test_a_mixed_precision_critic_values_and_steps_as_the_float32_one_to_bf16_accuracy(model_path):
    """bf16 passes over float32 weights: values within bf16's rounding of the
    float32 ones (and not equal: the passes ran in bf16), the value loss
    likewise, the weights still float32."""
    from rlflow.services.critic.torch_engine import CriticModel

    rng = np.random.default_rng(2)
    items = [(PromptGroup(group_id=g, prompt_ids=[3, 4, 5], n=1),
              [Response(np.asarray(rng.integers(3, 17, 8), np.int32), np.zeros(8, np.float32),
                        np.zeros(8, np.int32), FinishReason.STOP)]) for g in range(4)]
    batch = msgspec.structs.replace(build_batch(items), rewards=Tensor.of([1.0, 0.0, 1.0, 0.0], "float32"))
    values, stats = {}, {}
    for mixed in (False, True):
        model = CriticModel(TorchCritic(lr=1e-3, value_clip=0.0, mixed_precision=mixed), str(model_path))
        values[mixed] = model.values(batch)
        stats[mixed] = model.step(with_targets(batch, values[False]))
        assert all(p.dtype == torch.float32 for p in model.model.parameters())
    scale = float(np.abs(values[False]).max())
    assert 0 < float(np.abs(values[True] - values[False]).max()) < 0.05 * scale + 1e-3
    assert stats[True]["value_loss"] == pytest.approx(stats[False]["value_loss"], rel=0.05)


# -- the trainer's side ---------------------------------------------------------------------------


def test_per_token_advantages_go_through_the_decoupled_loss_with_truncated_weights(model_path):
    """advantage = "gae": the trainer scales the critic's per-token advantages
    over the step (whitened, here) and its loss is the clipped surrogate of each token's own
    advantage, reweighted by the truncated behaviour weight."""
    from rlflow.services.trainer.torch_engine import TorchEngine

    cfg = C.TorchTrainer(advantage="gae", correction="truncate", correction_high=1.5, lr=1e-4, advantage_norm="whiten",
                         decoupled=True)
    engine = TorchEngine(cfg, str(model_path))
    batch = _batch(lengths=((5,), (3,), (6,)), rewards=(1.0, 0.0, 1.0))
    rng = np.random.default_rng(2)
    advantages = rng.normal(size=batch.n_tokens).astype(np.float32)
    behaviour = rng.uniform(-6.0, -0.5, size=batch.n_tokens).astype(np.float32)
    batch = msgspec.structs.replace(batch, token_advantages=Tensor.from_numpy(advantages),
                                    logprobs=Tensor.from_numpy(behaviour))
    stats, (share,) = engine.prepare(batch, 1)
    whitened = share.token_advantages.numpy()
    np.testing.assert_allclose(whitened, whiten(advantages), atol=1e-6)
    # The loss by hand, at the weights before the step (ratio 1: nothing clipped).
    expected = 0.0
    with torch.no_grad():
        for row in samples(share):
            ids = torch.from_numpy(np.concatenate([row.prompt_ids, row.response_ids]).astype(np.int64))[None]
            logp = torch.log_softmax(engine.model(input_ids=ids).logits[0], -1)
            n = len(row.prompt_ids)
            picked = logp[torch.arange(n - 1, n - 1 + len(row.response_ids)),
                          torch.from_numpy(row.response_ids.astype(np.int64))]
            weight = torch.exp(picked - torch.from_numpy(row.logprobs)).clamp(max=1.5)
            expected -= float((weight * torch.from_numpy(row.token_advantages)).sum())
    out = engine.step(share)
    assert out["loss"] == pytest.approx(expected / batch.n_tokens, rel=1e-4)
    assert out["truncated_share"] > 0  # some behaviour weights were over the cap
    unscaled = TorchEngine(C.TorchTrainer(advantage="gae", advantage_norm="none"), str(model_path))
    _, (raw,) = unscaled.prepare(batch, 1)
    np.testing.assert_allclose(raw.token_advantages.numpy(), advantages, atol=1e-7)
    # The default: centred, over the spread of the returns the critic attached.
    returns = rng.choice([0.0, 1.0, 2.0], size=batch.n_tokens).astype(np.float32)
    by_returns = TorchEngine(C.TorchTrainer(advantage="gae"), str(model_path))
    _, (scaled,) = by_returns.prepare(msgspec.structs.replace(batch, returns=Tensor.from_numpy(returns)), 1)
    np.testing.assert_allclose(scaled.token_advantages.numpy(), (advantages - advantages.mean()) / returns.std(),
                               rtol=1e-5)


def test_a_batch_without_the_critics_columns_is_refused_by_a_gae_trainer(model_path):
    from rlflow.services.trainer.torch_engine import TorchEngine

    engine = TorchEngine(C.TorchTrainer(advantage="gae"), str(model_path))
    with pytest.raises(ValueError, match="without the column token_advantages reached"):
        engine.prepare(_batch(), 1)
    batch = _batch()
    advantages = msgspec.structs.replace(batch,
                                         token_advantages=Tensor.from_numpy(np.zeros(batch.n_tokens, np.float32)))
    with pytest.raises(ValueError, match="without the column returns reached"):
        engine.prepare(advantages, 1)


# -- config, plan, report -------------------------------------------------------------------------

BASE = {
    "pools": {"p": {}, "v": {}},
    "roles": {"rollout": {"pool": "p"}, "reward": {"pool": "p"},
              "trainer": {"pool": "p", "engine": {"kind": "torch", "advantage": "gae"}}},
}


def test_gae_needs_a_critic_and_a_critic_needs_gae():
    refused = r"roles.trainer.engine.advantage = 'gae': reads the column token_advantages, which no role of this " \
              r"config attaches \(\[roles.critic\] does"
    with pytest.raises(C.ConfigError, match=refused):
        C.build(BASE, {"pools": {"v": None}})
    with pytest.raises(C.ConfigError, match="would ignore the critic's advantages"):
        C.build(BASE, {"roles": {"critic": {"pool": "v"}}}, overrides=["roles.trainer.engine.advantage=grpo"])
    config = C.build(BASE, {"roles": {"critic": {"pool": "v", "engine": {"kind": "torch"}}}})
    assert [name for name, _ in config.role_items()] == ["rollout", "reward", "critic", "trainer"]
    with pytest.raises(C.ConfigError, match="roles.critic.lam"):
        C.build(BASE, {"roles": {"critic": {"pool": "v", "lam": 1.5}}})
    lora_base = {"roles": {"critic": {"pool": "v"}, "trainer": {"engine": {
        "kl_coef": 0.1, "kl_in": "reward", "lora": {"reference": "base"}}}}}
    with pytest.raises(C.ConfigError, match=r"roles.trainer.engine.kl_in = 'reward': with \[roles.critic\] a KL "
                                            r"penalty in the reward is folded into the returns by the critic"):
        C.build(BASE, lora_base)
    C.build(BASE, lora_base, overrides=["roles.trainer.engine.kl_in=loss"])


def test_the_planner_ranks_a_critic_pool_against_the_critic_on_the_trainers_devices():
    from rlflow.tools.plan import Learner, Workload, candidates, pools_section, simulate, table

    w = Workload(slots_per_device=256, step_s=0.0005, step_s_per_seq=0.0, trainer_device_s_per_token=4e-5,
                 lengths=(40, 80, 160), learner=Learner("critic", forward_s_per_token=0.7e-5, step_s_per_token=2e-5))
    inline = simulate(w, 2, 1)
    own = simulate(w, 2, 1, learner_devices=1)
    # The trainer is the bottleneck: a critic of its own saves the trainer the critic's share of each step.
    assert own.samples_per_s > 1.3 * inline.samples_per_s
    assert own.layout == "2+1+1" and inline.layout == "2+1i"
    ranked = candidates(w, 4)
    assert {p.layout for p in ranked} >= {"2+1+1", "1+2+1", "2+2i", "colocated"}
    assert "critic" in table(ranked).splitlines()[0]
    best = next(p for p in ranked if p.learner_devices)
    assert "[roles.critic]" in pools_section(best, w, gpus=True)
    plain = Workload(slots_per_device=256, step_s=0.0005, step_s_per_seq=0.0, trainer_device_s_per_token=4e-5,
                     lengths=(40, 80, 160))
    assert simulate(plain, 2, 1).samples_per_s > inline.samples_per_s  # the critic costs the one-worker layout


def test_the_report_names_the_critic_when_it_holds_the_run_back():
    from rlflow.rundir import StepRow
    from rlflow.services.critic.report import line as critic_line
    from rlflow.tools.report import bottleneck, role_lines

    fractions = {
        "rollout": {"busy": 0.55, "starved": 0.0, "blocked": 0.45},
        "reward": {"busy": 0.1, "starved": 0.5, "blocked": 0.4},
        "critic": {"busy": 0.96, "starved": 0.04, "blocked": 0.0},
        "trainer": {"busy": 0.6, "starved": 0.4},
    }
    assert bottleneck(fractions) == (
        "bottleneck: critic. trainer starved 40%: waiting for critic; rollout blocked 45% on critic; "
        "reward blocked 40% on critic; critic replicas busy 96%"
    )
    rows = [StepRow(step=i, version=i + 1, time_s=float(i), train={
        "critic_value_loss": 0.1, "critic_explained_var": 0.5, "critic_staleness_mean": 0.5,
        "critic_staleness_max": 1.0}) for i in range(3)]
    assert critic_line(rows) == ("critic over the last 3 steps: value loss 0.1000, explained variance 0.50; its "
                                 "values lagged the actor's step by 0.50 versions on average, 1 at most")
    assert critic_line([StepRow(step=0, version=1, time_s=0.0)]) == ""
    assert role_lines(rows) == [critic_line(rows)]  # the report reaches it through the registry


def test_the_advantages_of_a_batch_leave_failed_samples_out_and_take_a_penalty_at_every_token():
    from rlflow.algo.values import batch_gae
    from rlflow.protocol import SampleFailure, Stage

    batch = _batch(lengths=((2, 3), (2,)), rewards=(1.0, float("nan"), 0.5))
    batch = msgspec.structs.replace(batch, failures=[SampleFailure(index=2, stage=Stage.REWARD_END, kind="timeout")])
    values = np.array([0.5, 0.25, 0.0, 0.0, 0.0, 0.1, 0.2], np.float32)
    advantages, returns = batch_gae(batch, values, 1.0, 1.0, penalty=lambda row: np.full(len(row.response_ids), 0.1))
    # Sample 0: rewards [-0.1, 0.9]; lam = gamma = 1: each return is the rewards that follow.
    np.testing.assert_allclose(returns[:2], [0.8, 0.9], atol=1e-6)
    np.testing.assert_allclose(advantages[:2], [0.8 - 0.5, 0.9 - 0.25], atol=1e-6)
    assert np.isnan(returns[2:5]).all() and np.isnan(advantages[5:]).all()  # a NaN reward; a failed sample
    with pytest.raises(ValueError, match="without rewards"):
        batch_gae(msgspec.structs.replace(batch, rewards=None), values, 1.0, 1.0)


def test_the_advantages_of_an_episode_run_over_the_models_own_tokens():
    """Tokens [m m o o m] (o: the environment's observation, loss mask 0): GAE skips the
    observations (the value after the first turn's last token is the value before the second
    turn's first), which get advantage 0 and their own value as return; an episode that ends on
    observations ([m m m o o]) has its reward at the model's last token."""
    from rlflow.algo.values import batch_gae

    values = np.array([0.5, 0.25, 9.0, 9.0, 0.75], np.float32)

    def advantages_of(mask):
        response = Response(np.arange(3, 8, dtype=np.int32), np.zeros(5, np.float32), np.zeros(5, np.int32),
                            FinishReason.STOP, loss_mask=np.asarray(mask, np.uint8))
        batch = msgspec.structs.replace(build_batch([(PromptGroup(group_id=0, prompt_ids=[1], n=1), [response])]),
                                        rewards=Tensor.of([1.0], "float32"))
        return batch_gae(batch, values, 0.9, 0.8)

    advantages, returns = advantages_of([1, 1, 0, 0, 1])
    # The own tokens' values are [0.5, 0.25, 0.75]: the sums of the plain test above.
    d2, d1, d0 = 1.0 - 0.75, 0.9 * 0.75 - 0.25, 0.9 * 0.25 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    np.testing.assert_allclose(advantages, [a0, a1, 0.0, 0.0, a2], atol=1e-6)
    np.testing.assert_allclose(returns, [a0 + 0.5, a1 + 0.25, 9.0, 9.0, a2 + 0.75], atol=1e-6)
    advantages, returns = advantages_of([1, 1, 1, 0, 0])
    expected, _ = gae(token_rewards(1.0, 3), np.array([0.5, 0.25, 9.0]), 0.9, 0.8)
    np.testing.assert_allclose(advantages, [*expected, 0.0, 0.0], atol=1e-5)
    assert returns[3:].tolist() == [9.0, 0.75]


def test_the_newest_checkpoint_is_one_the_critic_finished_too(tmp_path):
    from rlflow.rundir import CONTROLLER_STATE, RUN_STATE, RunDir

    folder = RunDir(tmp_path)
    for step in (2, 4):
        folder.checkpoint(step).mkdir(parents=True)
        (folder.checkpoint(step) / CONTROLLER_STATE).write_text("{}")
    assert folder.latest_checkpoint().name == "step-000004"  # a run without a critic
    folder.role_checkpoint("critic", 2).mkdir()
    (folder.role_checkpoint("critic", 2) / RUN_STATE).write_text("{}")
    (folder.checkpoints / "critic-step-000004.tmp").mkdir()  # being written when the run died
    assert folder.latest_checkpoint().name == "step-000002"
