"""The value head's ridge fit (`core.value_fit`) from per-fold sufficient statistics, in float64."""

import pytest
import torch

from ppo_trainer.core.value_fit import FOLDS, fit_value_head, fold_statistics, ridge_solve, squared_error


def toy(n: int = 400, hidden: int = 6, noise: float = 0.1, seed: int = 0):
    """States [n, hidden] with one huge dimension (as hidden states have), returns linear in them plus
    noise, and folds 0..FOLDS-1 in runs of 10 tokens (a response's tokens share a fold)."""
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(n, hidden, generator=gen, dtype=torch.float64) * torch.tensor([1.0] * (hidden - 1) + [300.0])
    weight = torch.randn(hidden, generator=gen, dtype=torch.float64) / torch.tensor([1.0] * (hidden - 1) + [300.0])
    returns = states @ weight + 0.7 + noise * torch.randn(n, generator=gen, dtype=torch.float64)
    folds = (torch.arange(n) // 10) % FOLDS
    return states, returns, folds, weight


def test_ridge_solve_is_the_closed_form_with_an_unpenalised_bias():
    states, returns, folds, _ = toy(n=50, hidden=3)
    penalty = torch.tensor([0.5, 2.0, 7.0], dtype=torch.float64)
    x = torch.cat([states, torch.ones(50, 1, dtype=torch.float64)], dim=1)
    expected = torch.linalg.solve(x.T @ x + torch.diag(torch.tensor([0.5, 2.0, 7.0, 0.0], dtype=torch.float64)),
                                  x.T @ returns)
    stats = fold_statistics(states, returns, folds).sum(dim=0)
    coef = ridge_solve(stats, penalty)
    torch.testing.assert_close(coef, expected, rtol=1e-10, atol=1e-12)
    assert squared_error(stats, coef).item() == pytest.approx(((x @ coef - returns) ** 2).sum().item(), rel=1e-9)


def test_statistics_summed_over_parts_equal_the_whole_batchs():
    states, returns, folds, _ = toy()
    whole = fold_statistics(states, returns, folds)
    parts = fold_statistics(states[:123], returns[:123], folds[:123]) + fold_statistics(states[123:], returns[123:],
                                                                                        folds[123:])
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-9)
    assert whole[:, 6, 6].tolist() == [100.0] * FOLDS  # the constant's square: tokens per fold


def test_a_linear_target_is_fitted_with_little_shrinkage_and_explained_in_cross_validation():
    states, returns, folds, weight = toy(noise=0.01)
    fitted_weight, bias, metrics = fit_value_head(fold_statistics(states, returns, folds))
    torch.testing.assert_close(fitted_weight, weight, rtol=1e-2, atol=1e-3)
    assert bias.item() == pytest.approx(0.7, abs=0.01)
    assert metrics["ridge"] <= 1e-2 and metrics["cv_explained_var"] > 0.99


def test_a_target_the_states_do_not_predict_leaves_about_the_mean():
    states, _, folds, _ = toy()
    returns = 2.0 + torch.randn(len(states), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    weight, bias, metrics = fit_value_head(fold_statistics(states, returns, folds))
    assert metrics["ridge"] >= 10  # shrunk hard towards the bias alone
    assert bias.item() == pytest.approx(returns.mean().item(), abs=0.02)
    assert abs(metrics["cv_explained_var"]) < 0.02


def test_constant_returns_give_a_bias_only_head_and_no_explained_variance():
    states, _, folds, _ = toy()
    weight, bias, metrics = fit_value_head(fold_statistics(states, torch.full((len(states),), 0.25), folds))
    assert bias.item() == pytest.approx(0.25) and weight.abs().max().item() < 1e-6
    assert metrics["cv_explained_var"] == 0.0
