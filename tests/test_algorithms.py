"""Advantages and the policy loss against values computed by hand."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from rlflow.algo.losses import (
    LossConfig,
    group_advantages,
    normaliser_weights,
    policy_loss,
    token_logprobs,
    uniform_groups,
)


def test_grpo_advantages_are_group_normalised():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    group = torch.tensor([7, 7, 7, 7, 9, 9])
    adv = group_advantages(rewards, group, kind="grpo", eps=0.0)
    # Group 7: mean 0.25, population std sqrt(0.1875) = 0.4330.
    std = math.sqrt(0.1875)
    assert adv[:4].tolist() == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])
    # Group 9: all equal, advantage 0 (not NaN).
    assert adv[4:].tolist() == [0.0, 0.0]
    plain = group_advantages(rewards, group, kind="grpo", normalize_std=False)
    assert plain[:4].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_subtracts_the_mean_of_the_others():
    rewards = torch.tensor([3.0, 1.0, 2.0, 5.0])
    group = torch.tensor([0, 0, 0, 1])
    adv = group_advantages(rewards, group, kind="rloo")
    # 3 - mean(1, 2) = 1.5; 1 - mean(3, 2) = -1.5; 2 - mean(3, 1) = 0; a group of one: 0.
    assert adv.tolist() == pytest.approx([1.5, -1.5, 0.0, 0.0])


def test_uniform_groups_are_found():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5])
    group = torch.tensor([1, 1, 2, 2, 3])
    assert uniform_groups(rewards, group).tolist() == [True, True, False, False, True]


def test_unknown_estimator_is_an_error():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        group_advantages(torch.zeros(2), torch.zeros(2), kind="ppo")


def lp(*values: float) -> torch.Tensor:
    return torch.log(torch.tensor(values, dtype=torch.float32))


def test_ratio_and_clipping_without_decoupling():
    cfg = LossConfig(clip_low=0.2, clip_high=0.2, decoupled=False)
    # ratios current / behaviour: 1.5 (clipped to 1.2 for a positive advantage),
    # 0.5 (clipped to 0.8 for a negative advantage), 1.1 (inside).
    current = lp(0.6, 0.2, 0.55)
    behaviour = lp(0.4, 0.4, 0.5)
    adv = torch.tensor([1.0, -1.0, 2.0])
    out = policy_loss(current, current, behaviour, adv, cfg)
    # min(1.5 * 1, 1.2 * 1) = 1.2; min(0.5 * -1, 0.8 * -1) = -0.8; min(1.1 * 2, 1.1 * 2) = 2.2.
    assert out.loss.item() == pytest.approx(-(1.2 - 0.8 + 2.2), rel=1e-5)
    assert out.clipped.item() == 2


def test_decoupled_objective_clips_against_the_proximal_policy_and_reweights():
    cfg = LossConfig(clip_low=0.2, clip_high=0.2, decoupled=True, tis_cap=2.0)
    current = lp(0.5, 0.5)
    proximal = lp(0.4, 0.5)
    behaviour = lp(0.1, 0.4)
    adv = torch.tensor([1.0, 1.0])
    out = policy_loss(current, proximal, behaviour, adv, cfg)
    # ratios current / proximal: 1.25 -> clipped 1.2; 1.0.
    # behaviour weights proximal / behaviour: 4.0 -> truncated to 2.0; 1.25.
    assert out.loss.item() == pytest.approx(-(2.0 * 1.2 + 1.25 * 1.0), rel=1e-5)
    assert out.truncated.item() == 1 and out.clipped.item() == 1
    uncapped = policy_loss(current, proximal, behaviour, adv, LossConfig(clip_low=0.2, clip_high=0.2, tis_cap=0.0))
    assert uncapped.loss.item() == pytest.approx(-(1.2 + 1.0), rel=1e-5)  # no correction


def test_with_one_step_the_gradient_is_the_weighted_policy_gradient():
    """Proximal = current (detached), as the trainer uses it: the ratio is 1,
    nothing is clipped, and the gradient is -weight * advantage * grad log p."""
    logits = torch.tensor([[0.2, -0.1, 0.5]], requires_grad=True)
    targets = torch.tensor([2])
    current = token_logprobs(logits, targets)
    behaviour = current.detach() - 0.3  # proximal / behaviour = e^0.3
    out = policy_loss(current, current.detach(), behaviour, torch.tensor([2.0]), LossConfig(tis_cap=5.0))
    out.loss.backward()
    probs = torch.softmax(logits.detach(), -1)[0]
    expected = -math.exp(0.3) * 2.0 * (torch.nn.functional.one_hot(targets, 3)[0] - probs)
    assert logits.grad[0].tolist() == pytest.approx(expected.tolist(), rel=1e-5)
    assert out.clipped.item() == 0


def test_loss_normalisers_by_hand():
    """Four samples of 2, 4, 3 and 1 tokens; the second and third (T = 7
    tokens) are trained on, the others are in a group without signal."""
    lengths = torch.tensor([2, 4, 3, 1])
    trained = torch.tensor([False, True, True, False])
    assert normaliser_weights(lengths, trained, "trained_tokens").tolist() == [1.0, 1.0]
    # Divided by every response token of the batch (10), not by T = 7: 7 / 10.
    assert normaliser_weights(lengths, trained, "batch_tokens").tolist() == pytest.approx([0.7, 0.7])
    # Each sample's token mean over 4 samples: T / (N L_i) = 7 / 16, 7 / 12.
    assert normaliser_weights(lengths, trained, "sequences").tolist() == pytest.approx([7 / 16, 7 / 12])
    with pytest.raises(ValueError, match="unknown loss normaliser 'max'"):
        normaliser_weights(lengths, trained, "max")


def test_a_normaliser_as_advantage_factors_gives_its_loss():
    """What the trainer computes (each advantage times its factor, the token
    sum divided by the tokens trained on) equals each normaliser's loss
    written out by hand, gradient included."""
    logits = torch.tensor([[0.1, 0.4], [0.3, -0.2], [0.0, 0.5], [-0.4, 0.2], [0.2, 0.2]], requires_grad=True)
    targets = torch.tensor([0, 1, 1, 0, 1])
    per_sample = [torch.tensor(1.5), torch.tensor(-0.5)]  # samples of 2 and 3 tokens, trained on
    lengths, trained = torch.tensor([2, 3, 4]), torch.tensor([True, True, False])  # a third, of 4 tokens, is not
    cfg = LossConfig()

    def trainer_loss(norm: str) -> torch.Tensor:
        w = normaliser_weights(lengths, trained, norm)
        adv = torch.cat([(a * wi).repeat(int(n)) for a, wi, n in zip(per_sample, w, lengths[trained])])
        current = token_logprobs(logits, targets)
        return policy_loss(current, current.detach(), current.detach(), adv, cfg).loss / 5

    def by_hand(norm: str) -> torch.Tensor:
        logp = token_logprobs(logits, targets)
        ratio = torch.exp(logp - logp.detach())  # 1, with the gradient of log p
        first, second = -(ratio[:2] * 1.5), -(ratio[2:] * -0.5)
        if norm == "batch_tokens":
            return (first.sum() + second.sum()) / 9
        return (first.mean() + second.mean()) / 3  # sequences: the third sample's mean is 0

    for norm in ("batch_tokens", "sequences"):
        logits.grad = None
        got = trainer_loss(norm)
        got.backward()
        got_grad = logits.grad.clone()
        logits.grad = None
        want = by_hand(norm)
        want.backward()
        assert got.item() == pytest.approx(want.item(), rel=1e-5)
        assert got_grad.flatten().tolist() == pytest.approx(logits.grad.flatten().tolist(), rel=1e-5)


def test_token_logprobs_with_temperature():
    logits = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    targets = torch.tensor([0, 1])
    got = token_logprobs(logits, targets, temperature=2.0)
    assert got.tolist() == pytest.approx([1 - math.log(math.e + 1), -math.log(2)], rel=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4096), max_size=64), st.integers(1, 8))
def test_deal_gives_every_rank_about_as_many_tokens(lengths, ranks):
    from rlflow.algo.balance import deal

    shares = deal(lengths, ranks)
    assert len(shares) == ranks
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    assert all(share == sorted(share) for share in shares)
    loads = [sum(lengths[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(lengths, default=0)
    assert deal(lengths, ranks) == shares


def test_deal_spreads_a_long_tail_one_per_rank():
    from rlflow.algo.balance import deal

    # Two long samples and many short ones: each rank gets one long one.
    shares = deal([1000, 10, 10, 10, 1000, 10, 10, 10], 2)
    assert [sorted(i for i in share if i in (0, 4)) for share in shares] == [[0], [4]]
    assert [sum([1000, 10, 10, 10, 1000, 10, 10, 10][i] for i in s) for s in shares] == [1030, 1030]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), max_size=64), st.integers(1, 1024))
def test_micro_batches_stay_within_the_token_budget(lengths, budget):
    from rlflow.algo.balance import micro_batches

    parts = micro_batches(lengths, budget)
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    for part in parts:
        assert len(part) == 1 or max(lengths[i] for i in part) * len(part) <= budget
