"""explained_variance, approx_kl, clip_fraction, the logprob gap and the value error by third over valid tokens."""

import math

import pytest
import torch

from ppo_trainer.core.gae import compute_gae
from ppo_trainer.core.metrics import (
    approx_kl,
    clip_fraction,
    explained_variance,
    logprob_gap_metrics,
    value_error_by_third,
)

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
RETURNS = torch.tensor([[1.0, 2.0, 4.0, 99.0], [-1.0, 3.0, -50.0, 7.0]])


def test_explained_variance_of_perfect_prediction_is_one():
    values = torch.where(MASK.bool(), RETURNS, 123.0)
    assert explained_variance(values, RETURNS, MASK).item() == pytest.approx(1.0)


def test_explained_variance_of_the_constant_mean_prediction_is_zero():
    mean = (1.0 + 2.0 + 4.0 - 1.0 + 3.0) / 5
    assert explained_variance(torch.full_like(RETURNS, mean), RETURNS, MASK).item() == pytest.approx(0.0, abs=1e-6)


def test_explained_variance_of_a_halfway_prediction():
    # residual R - 0.5 R has a quarter of Var[R]
    assert explained_variance(0.5 * RETURNS, RETURNS, MASK).item() == pytest.approx(0.75)


def test_explained_variance_is_zero_when_returns_are_constant():
    assert explained_variance(torch.randn(2, 4), torch.ones(2, 4), MASK).item() == 0.0


def test_explained_variance_is_zero_when_returns_are_zero_up_to_rounding():
    # A batch where every score is 0 (a sparse task early on): with gamma = lam = 1 the returns
    # A + V are exactly 0 in real arithmetic, only float rounding of the GAE sums is left. That
    # is nothing to explain; dividing by its ~1e-17 variance reported about -1e15.
    torch.manual_seed(0)
    mask = torch.ones(256, 3)
    values = 0.1 * torch.randn(256, 3)
    rewards = torch.zeros(256, 3)
    _, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert returns.abs().max() < 1e-6
    assert explained_variance(values, returns, mask).item() == 0.0


def test_explained_variance_of_small_but_real_returns():
    returns = torch.tensor([[1e-4, 2e-4, 4e-4, 0.0], [-1e-4, 3e-4, 0.0, 0.0]])
    assert explained_variance(0.5 * returns, returns, MASK).item() == pytest.approx(0.75)


def test_approx_kl_is_mean_of_old_minus_new_logprobs_on_valid_tokens():
    old = torch.tensor([[0.0, -1.0, -2.0, 5.0], [-1.0, 0.0, 0.0, 0.0]])
    new = torch.tensor([[-1.0, -1.0, -1.0, 0.0], [-2.0, -1.0, 9.0, 9.0]])
    assert approx_kl(new, old, MASK).item() == pytest.approx((1.0 + 0.0 - 1.0 + 1.0 + 1.0) / 5)


def test_clip_fraction_counts_valid_tokens_only():
    clipped = torch.tensor([[True, False, True, True], [False, False, True, True]])
    assert clip_fraction(clipped, MASK).item() == pytest.approx(2 / 5)


def test_logprob_gap_metrics_counts_only_real_response_tokens():
    sample = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, 0.0, 0.0]])
    recomputed = torch.tensor([[-1.5, -2.0, 0.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    metrics = logprob_gap_metrics(sample, recomputed, mask)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(0.5)
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx((0.5 + 0.0 + 0.25) / 3)


def test_logprob_gap_metrics_of_an_empty_mask_are_zero():
    zeros = torch.zeros(2, 3)
    assert logprob_gap_metrics(zeros, zeros + 1, zeros.long()) == {
        "rollout/logprob_diff_max": 0.0,
        "rollout/logprob_diff_mean": 0.0,
    }


def test_value_error_by_third_pools_each_third_of_every_response_by_hand():
    nan = float("nan")  # masked positions hold garbage that must not count
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0],  # 6 tokens: thirds 0 0 1 1 2 2
                         [1, 0, 1, 1, 0, 0, 0],  # a token masked inside: 3 valid tokens, thirds 0 1 2
                         [1, 0, 0, 0, 0, 0, 0],  # 1 token: early
                         [1, 1, 0, 0, 0, 0, 0],  # 2 tokens: early, middle
                         [0, 0, 0, 0, 0, 0, 0]], dtype=torch.float64)  # empty
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, nan],
                           [0.5, nan, 1.5, 2.5, nan, nan, nan],
                           [3.0, nan, nan, nan, nan, nan, nan],
                           [1.0, 2.0, nan, nan, nan, nan, nan],
                           [nan] * 7], dtype=torch.float64)
    returns = torch.where(mask.bool(), 0.0, torch.inf).double()  # the error is values^2
    out = value_error_by_third(values, returns, mask)
    assert out == pytest.approx({"critic/vf_error/early": (1 + 4 + 0.25 + 9 + 1) / 5,
                                 "critic/vf_error/middle": (9 + 16 + 2.25 + 4) / 4,
                                 "critic/vf_error/late": (25 + 36 + 6.25) / 3}, rel=1e-12)


def test_value_error_of_a_third_no_response_reaches_is_nan():
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]])
    out = value_error_by_third(torch.tensor([[2.0, 0, 0], [1.0, 3.0, 0]]), torch.zeros(2, 3), mask)
    assert out["critic/vf_error/early"] == pytest.approx((4 + 1) / 2)
    assert out["critic/vf_error/middle"] == pytest.approx(9.0)
    assert math.isnan(out["critic/vf_error/late"])
