"""policy_loss, value_loss, kl_penalty, aggregate and the positive-example LM loss on hand-computed cases."""

import math

import pytest
import torch

from ppo_trainer.config.schema import AlgorithmConfig
from ppo_trainer.core.losses import (
    actor_loss,
    aggregate,
    kl_penalty,
    policy_loss,
    positive_examples,
    positive_lm_loss,
    value_loss,
)


def test_policy_loss_with_ratio_one_is_the_unclipped_surrogate():
    advantages = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -3.0, -3.0]])
    logprobs = old.clone().requires_grad_(True)
    out = policy_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.2)
    assert out.loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5 + 3.0) / 4)
    assert out.clipfrac.item() == 0.0 and out.approx_kl.item() == 0.0
    dual = policy_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert dual.loss.item() == out.loss.item()  # at ratio 1 the dual clip is never active
    out.loss.backward()
    # d/dlogp of -A * exp(logp - old) at ratio 1 is -A, over 4 valid tokens.
    torch.testing.assert_close(logprobs.grad, -advantages * mask / 4)


@pytest.mark.parametrize(
    "advantage,ratio,expected,clipped",
    [
        (1.0, 1.5, -1.28, True),  # above 1 + clip_high: capped at 1.28
        (1.0, 0.5, -0.5, False),  # pessimistic bound keeps the unclipped, worse term
        (-1.0, 0.5, 0.8, True),  # below 1 - clip_low: capped at 0.8
        (-1.0, 1.5, 1.5, False),
    ],
)
def test_policy_loss_clips_ratio_to_separate_low_and_high_bounds(advantage, ratio, expected, clipped):
    out = policy_loss(
        torch.tensor([[math.log(ratio)]]), torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1),
        clip_low=0.2, clip_high=0.28,
    )
    assert out.loss.item() == pytest.approx(expected)
    assert out.clipfrac.item() == float(clipped)
    assert out.approx_kl.item() == pytest.approx(-math.log(ratio))


def test_dual_clip_bounds_the_loss_of_negative_advantages_at_c_times_minus_a():
    # ratio e^2 ~ 7.39: A = -1 gives loss 7.39 without dual clip, capped at 3 * 1 with c = 3;
    # A = +1 is clipped as usual to -1.2 and untouched by the dual clip.
    logprobs = torch.tensor([[2.0, 2.0]])
    old = torch.zeros(1, 2)
    advantages = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    plain = policy_loss(logprobs, old, advantages, mask, 0.2, 0.2, agg="seq-mean-token-sum")
    assert plain.loss.item() == pytest.approx(math.exp(2.0) - 1.2)
    dual = policy_loss(logprobs, old, advantages, mask, 0.2, 0.2, dual_clip=3.0, agg="seq-mean-token-sum")
    assert dual.loss.item() == pytest.approx(3.0 - 1.2)
    # the dual clip is active on the A < 0 token only: alone, its loss is exactly c * -A
    alone = policy_loss(logprobs[:, :1], old[:, :1], advantages[:, :1], mask[:, :1], 0.2, 0.2, dual_clip=3.0)
    assert alone.loss.item() == pytest.approx(3.0)
    assert dual.clipfrac.item() == 0.5


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.2, dual_clip=1.0)


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_and_gradients_stay_finite_for_a_huge_log_ratio(log_ratio, dual_clip):
    # exp(100) overflows float32 to inf; the clamp of the ratio then passes 0 * inf = NaN back.
    logprobs = torch.tensor([[log_ratio, 0.0]], requires_grad=True)
    out = policy_loss(logprobs, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), 0.2, 0.2,
                      dual_clip=dual_clip)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logprobs.grad).all()
    # The clamp at +-20 keeps the loss of the clamped token what it is at log-ratio 20.
    at_bound = policy_loss(torch.tensor([[math.copysign(20.0, log_ratio), 0.0]]), torch.zeros(1, 2),
                           torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), 0.2, 0.2, dual_clip=dual_clip)
    assert out.loss.item() == pytest.approx(at_bound.loss.item())


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_kl_penalties_and_gradients_stay_finite_for_a_huge_log_ratio(kind):
    logprobs = torch.tensor([100.0, -100.0], requires_grad=True)
    kl = kl_penalty(logprobs, torch.zeros(2), kind)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logprobs.grad).all()


def test_value_loss_clipped_by_hand():
    # token 0: v moved 0.5 away from v_old=0.5, clipped to 0.7: max(1.0, 0.49) -> 0.5 * 1.0
    # token 1: v=2.9 moved toward R=3 beyond the clip: max(0.01, (2.2 - 3)^2=0.64) -> 0.32
    values = torch.tensor([[1.0, 2.9, 123.0]])
    old_values = torch.tensor([[0.5, 2.0, -5.0]])
    returns = torch.tensor([[0.0, 3.0, 7.0]])
    mask = torch.tensor([[1, 1, 0]])
    out = value_loss(values, old_values, returns, mask, clip=0.2)
    assert out.loss.item() == pytest.approx((0.5 + 0.32) / 2)
    assert out.clipfrac.item() == 0.5


def test_value_loss_unclipped_by_hand():
    values = torch.tensor([[1.0, 2.9, 123.0]])
    returns = torch.tensor([[0.0, 3.0, 7.0]])
    out = value_loss(values, torch.zeros(1, 3), returns, torch.tensor([[1, 1, 0]]), clip=None)
    assert out.loss.item() == pytest.approx((0.5 * 1.0 + 0.5 * 0.01) / 2)
    assert out.clipfrac.item() == 0.0


def test_value_loss_gradient_is_cut_where_clip_is_active():
    values = torch.tensor([[1.0, 2.9]], requires_grad=True)
    out = value_loss(values, torch.tensor([[0.5, 2.0]]), torch.tensor([[0.0, 3.0]]), torch.ones(1, 2), clip=0.2)
    out.loss.backward()
    # token 0: d/dv 0.5 (v - R)^2 / 2 = (1 - 0) / 2; token 1: clipped term is constant in v.
    assert values.grad.tolist() == [[0.5, 0.0]]


# logp - ref = (1, 0, -2); ref - logp = (-1, 0, 2)
KL_CASES = {
    "k1": [1.0, 0.0, -2.0],
    "abs": [1.0, 0.0, 2.0],
    "k2": [0.5, 0.0, 2.0],
    "k3": [math.exp(-1.0), 0.0, math.exp(2.0) - 3.0],
}


@pytest.mark.parametrize("kind", sorted(KL_CASES))
def test_kl_penalty_kinds_on_known_inputs(kind):
    logprobs = torch.tensor([0.0, -1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(logprobs, ref, kind), torch.tensor(KL_CASES[kind], dtype=torch.float64))


def test_k3_is_clamped_to_ten_with_finite_gradients():
    logprobs = torch.tensor([-200.0, 0.0, 200.0], requires_grad=True)
    kl = kl_penalty(logprobs, torch.zeros(3), "k3")
    assert kl.tolist() == [10.0, 0.0, 10.0]
    kl.sum().backward()
    assert logprobs.grad.tolist() == [0.0, 0.0, 0.0]


def test_unknown_kl_kind_names_the_allowed_values():
    with pytest.raises(ValueError, match="'k4'.*k1, abs, k2, k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
AGG_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-mean", (1.5 + 4.0 + 0.0) / 3),  # the empty row counts as 0
        ("seq-mean-token-sum", (3.0 + 4.0 + 0.0) / 3),
    ],
)
def test_aggregate_modes_by_hand(mode, expected):
    assert aggregate(LOSS_MAT, AGG_MASK, mode).item() == pytest.approx(expected)


def test_aggregate_divides_by_the_global_counts_when_given():
    assert aggregate(LOSS_MAT, AGG_MASK, "token-mean", global_tokens=10).item() == pytest.approx(0.7)
    assert aggregate(LOSS_MAT, AGG_MASK, "seq-mean-token-sum", global_seqs=7).item() == pytest.approx(1.0)
    assert aggregate(LOSS_MAT, AGG_MASK, "seq-mean-token-mean", global_seqs=torch.tensor(11)).item() == pytest.approx(0.5)


def test_aggregate_of_an_all_masked_batch_is_zero():
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert aggregate(LOSS_MAT, torch.zeros(3, 3), mode).item() == 0.0


def test_unknown_aggregation_mode_names_the_allowed_values():
    with pytest.raises(ValueError, match="'mean'.*token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        aggregate(LOSS_MAT, AGG_MASK, "mean")


def test_positive_examples_are_the_correct_responses_or_the_best_of_a_group_that_differs():
    scores = torch.tensor([1.0, 0.1, 0.0, 1.2, 0.1, 0.1, 0.5, 0.2])
    groups = [[0, 1], [2, 3], [4, 5], [6, 7]]
    correct = positive_examples(scores, groups, "correct", correct_score=1.0)
    assert correct.tolist() == [True, False, False, True, False, False, False, False]
    best = positive_examples(scores, groups, "group_best", correct_score=1.0)
    assert best.tolist() == [True, False, False, True, False, False, True, False]  # [4, 5] alike: neither


def test_positive_lm_loss_is_the_mean_nll_over_the_positive_tokens_of_the_mini_batch_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 9.0], [-4.0, -4.0, -4.0]],
                            dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    positive = torch.tensor([True, True, False])
    # tokens of rows 0 and 1: -(-1 - 2 - 0.5 - 0.25) = 3.75 over this micro-batch's 4, or a mini-batch's 10
    assert positive_lm_loss(logprobs, positive, mask, 4).item() == pytest.approx(3.75 / 4, rel=1e-15)
    loss = positive_lm_loss(logprobs, positive, mask, 10)
    assert loss.item() == pytest.approx(0.375, rel=1e-15)
    loss.backward()
    expected = torch.tensor([[-0.1, -0.1, 0.0], [-0.1, -0.1, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected, rtol=0, atol=1e-15)
    assert positive_lm_loss(logprobs, torch.zeros(3, dtype=torch.bool), mask, 0).item() == 0.0


def test_actor_loss_adds_the_positive_lm_loss_times_its_coefficient():
    logprobs = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], dtype=torch.float64)
    mask = torch.ones(2, 2)
    algorithm = AlgorithmConfig(positive_lm_loss_coef=0.5)
    args = (logprobs, None, logprobs, torch.zeros(2, 2, dtype=torch.float64), mask, None, None)
    without, off = actor_loss(*args, AlgorithmConfig(), 4, 2)
    loss, stats = actor_loss(*args, algorithm, 4, 2, torch.tensor([False, True]), 2)
    assert "positive_lm_loss" not in off
    assert stats["positive_lm_loss"].item() == pytest.approx(3.5)  # (3 + 4) / 2 positive tokens
    assert (loss - without).item() == pytest.approx(0.5 * 3.5)
