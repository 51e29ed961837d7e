"""explained_variance, approx_kl, clip_fraction and the logprob gap over valid tokens."""

import pytest
import torch

from ppo_trainer.core.gae import compute_gae
from ppo_trainer.core.metrics import approx_kl, clip_fraction, explained_variance, logprob_gap_metrics

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
