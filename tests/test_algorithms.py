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
    cfg = LossConfig(clip_low=0.2, clip_high=0.2, decoupled=True, correction="truncate", high=2.0)
    current = lp(0.5, 0.5)
    proximal = lp(0.4, 0.5)
    behaviour = lp(0.1, 0.4)
    adv = torch.tensor([1.0, 1.0])
    out = policy_loss(current, proximal, behaviour, adv, cfg)
    # ratios current / proximal: 1.25 -> clipped 1.2; 1.0.
    # behaviour weights proximal / behaviour: 4.0 -> truncated to 2.0; 1.25.
    assert out.loss.item() == pytest.approx(-(2.0 * 1.2 + 1.25 * 1.0), rel=1e-5)
    assert out.truncated.item() == 1 and out.clipped.item() == 1
    uncapped = policy_loss(current, proximal, behaviour, adv, LossConfig(clip_low=0.2, clip_high=0.2))
    assert uncapped.loss.item() == pytest.approx(-(1.2 + 1.0), rel=1e-5)  # no correction


def test_with_one_step_the_gradient_is_the_weighted_policy_gradient():
    """Proximal = current (detached), as the trainer uses it: the ratio is 1,
    nothing is clipped, and the gradient is -weight * advantage * grad log p."""
    logits = torch.tensor([[0.2, -0.1, 0.5]], requires_grad=True)
    targets = torch.tensor([2])
    current = token_logprobs(logits, targets)
    behaviour = current.detach() - 0.3  # proximal / behaviour = e^0.3
    cfg = LossConfig(correction="truncate", high=5.0)
    out = policy_loss(current, current.detach(), behaviour, torch.tensor([2.0]), cfg)
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


# -- the mismatch corrections and the objectives, by hand ----------------------


def test_a_token_mask_leaves_out_the_tokens_outside_its_bounds():
    # Behaviour weights proximal / behaviour: 4.0, 1.25, 0.25 against bounds [0.5, 2].
    proximal, behaviour = lp(0.4, 0.5, 0.1), lp(0.1, 0.4, 0.4)
    current = lp(0.4, 0.5, 0.1)  # ratio 1 to the proximal policy
    adv = torch.tensor([1.0, 1.0, -1.0])
    decoupled = policy_loss(current, proximal, behaviour, adv,
                            LossConfig(decoupled=True, correction="mask", low=0.5, high=2.0))
    assert decoupled.weight.tolist() == pytest.approx([0.0, 1.25, 0.0])  # kept tokens weigh w
    assert decoupled.loss.item() == pytest.approx(-1.25, rel=1e-5) and decoupled.masked.item() == 2
    # Not decoupled (IcePop): the ratio is to the behaviour policy; kept tokens weigh 1.
    plain = policy_loss(current, proximal, behaviour, adv,
                        LossConfig(decoupled=False, clip_low=0.2, clip_high=0.28, correction="mask", low=0.5,
                                   high=2.0))
    assert plain.weight.tolist() == [0.0, 1.0, 0.0]
    assert plain.loss.item() == pytest.approx(-1.25, rel=1e-5)  # ratio 1.25 to the behaviour, inside [0.8, 1.28]


def test_a_sequence_level_weight_is_the_geometric_mean_of_its_tokens():
    # Sample 0: token weights 4 and 1 (geometric mean 2); sample 1: 0.25 alone.
    proximal, behaviour = lp(0.4, 0.5, 0.1), lp(0.1, 0.5, 0.4)
    sample = torch.tensor([0, 0, 1])
    adv = torch.tensor([1.0, 1.0, 1.0])
    truncated = policy_loss(proximal, proximal, behaviour, adv,
                            LossConfig(correction="truncate", level="sequence", high=1.5), sample)
    assert truncated.weight.tolist() == pytest.approx([1.5, 1.5, 0.25])
    assert truncated.truncated.item() == 2
    masked = policy_loss(proximal, proximal, behaviour, adv,
                         LossConfig(correction="mask", level="sequence", low=0.5, high=2.5), sample)
    assert masked.weight.tolist() == pytest.approx([2.0, 2.0, 0.0]) and masked.masked.item() == 1
    with pytest.raises(ValueError, match="needs each token's sample"):
        policy_loss(proximal, proximal, behaviour, adv, LossConfig(correction="mask", level="sequence"))


def test_gspo_clips_the_sequences_ratio_and_its_gradient_is_the_sequences():
    """Sample 0 of two tokens, ratios 1.5 and 1.0 to the behaviour (geometric
    mean 1.2247 > 1.1: clipped for a positive advantage, no gradient); sample
    1 of one token, ratio 1.05 (inside): loss -s A, gradient -s A grad log p."""
    logits = torch.tensor([[0.3, 0.1], [0.2, -0.4], [0.0, 0.6]], requires_grad=True)
    targets = torch.tensor([0, 1, 1])
    current = token_logprobs(logits, targets)
    behaviour = current.detach() - torch.log(torch.tensor([1.5, 1.0, 1.05]))
    sample = torch.tensor([0, 0, 1])
    adv = torch.tensor([1.0, 1.0, 2.0])
    out = policy_loss(current, current.detach(), behaviour, adv,
                      LossConfig(decoupled=False, objective="gspo", clip_low=0.1, clip_high=0.1), sample)
    s0 = math.sqrt(1.5)
    assert out.loss.item() == pytest.approx(-(1.1 * 1 * 2 + 1.05 * 2), rel=1e-5)
    assert out.clipped.item() == 2  # both tokens of sample 0
    out.loss.backward()
    probs = torch.softmax(logits.detach(), -1)
    hand = torch.zeros(3, 2)
    hand[2] = -1.05 * 2.0 * (torch.nn.functional.one_hot(targets[2], 2) - probs[2])
    assert logits.grad.flatten().tolist() == pytest.approx(hand.flatten().tolist(), rel=1e-5, abs=1e-7)
    assert s0 > 1.1


def test_cispo_keeps_the_gradient_of_a_clipped_token():
    """Ratios 1.5 (clipped to 1.28) and 0.5 (clipped to 0.8): the loss is
    -sum sg(clip(r)) A log p, so both tokens keep a gradient, PPO's would not."""
    logits = torch.tensor([[0.3, 0.1], [0.2, -0.4]], requires_grad=True)
    targets = torch.tensor([0, 1])
    current = token_logprobs(logits, targets)
    behaviour = current.detach() - torch.log(torch.tensor([1.5, 0.5]))
    adv = torch.tensor([1.0, -1.0])
    out = policy_loss(current, current.detach(), behaviour, adv,
                      LossConfig(decoupled=False, objective="cispo", clip_low=0.2, clip_high=0.28))
    logp = current.detach()
    assert out.loss.item() == pytest.approx(-(1.28 * 1.0 * logp[0] + 0.8 * -1.0 * logp[1]).item(), rel=1e-5)
    assert out.clipped.item() == 2
    out.loss.backward()
    probs = torch.softmax(logits.detach(), -1)
    onehot = torch.nn.functional.one_hot(targets, 2)
    hand = -torch.tensor([[1.28 * 1.0], [0.8 * -1.0]]) * (onehot - probs)
    assert logits.grad.flatten().tolist() == pytest.approx(hand.flatten().tolist(), rel=1e-5)
    ppo = token_logprobs(logits.detach().requires_grad_(), targets)
    assert policy_loss(ppo, ppo.detach(), behaviour, adv, LossConfig(decoupled=False)).clipped.item() == 2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"decoupled": False, "correction": "truncate"}, "needs decoupled"),
    ({"correction": "truncate", "low": 0.5}, "a lower bound is mask's"),
    ({"correction": "mask", "low": 2.0, "high": 2.0}, "0 <= low < high"),
    ({"objective": "grpo"}, "unknown objective 'grpo'"),
    ({"correction": "clip"}, "unknown correction 'clip'"),
])
def test_a_correction_that_cannot_be_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)


def test_the_gap_by_hand():
    from rlflow.algo.gap import EDGES, Gap
    from rlflow.services.fsdp import Solo

    gap = Gap()
    # 100 tokens of two samples: 98 with a gap of 0.001, one of 0.5, one of -2.0 (log p_train - log p_behaviour).
    diff = torch.full((100,), 0.001, dtype=torch.float64)
    diff[10], diff[90] = 0.5, -2.0
    behaviour = torch.zeros(100)
    sample = torch.tensor([0] * 50 + [1] * 50)
    gap.add(diff.float(), behaviour, sample)
    stats = gap.stats(Solo())
    assert stats["gap_mean"] == pytest.approx((98 * 0.001 + 0.5 + 2.0) / 100, rel=1e-5)
    assert stats["gap_max"] == pytest.approx(2.0)
    # The 99th of 100 sorted gaps is 0.5: within its bin's 12%.
    assert 0.5 <= stats["gap_p99"] <= 0.5 * 1.13
    assert stats["seq_weight_max"] == pytest.approx(math.exp((49 * 0.001 + 0.5) / 50), rel=1e-5)
    assert stats["seq_weight_min"] == pytest.approx(math.exp((49 * 0.001 - 2.0) / 50), rel=1e-5)
    assert len(EDGES) == 201 and Gap().stats(Solo()) == {}
