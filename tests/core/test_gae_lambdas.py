"""GAE with one lambda per sequence (VAPO's length-adaptive lambda) against a slow reference."""

import pytest
import torch

from ppo_trainer.core.gae import adaptive_lambda, compute_gae

from .test_gae import reference_gae


def reference_adaptive_lambda(mask, alpha):
    out = []
    for row in mask.tolist():
        length = sum(1 for m in row if m)
        out.append(0.0 if length == 0 else min(1.0, max(0.0, 1 - 1 / (alpha * length))))
    return out


def ragged(seed, B=16, T=41, right_padded=True):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    if right_padded:
        lengths = torch.randint(0, T + 1, (B,), generator=gen)
        mask = (torch.arange(T) < lengths[:, None]).long()
    else:
        mask = (torch.rand(B, T, generator=gen) < 0.6).long()
    return rewards, values, mask


@pytest.mark.parametrize("right_padded", [True, False], ids=["right-padded", "arbitrary-mask"])
@pytest.mark.parametrize("gamma", [1.0, 0.97])
def test_per_sequence_lambda_matches_a_slow_float64_reference(right_padded, gamma):
    for seed in range(3):
        rewards, values, mask = ragged(seed, right_padded=right_padded)
        lams = torch.rand(mask.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        advantages, returns = compute_gae(rewards, values, mask, gamma, lams)
        ref_advantages, ref_returns = reference_gae(rewards, values, mask, gamma, lams.tolist())
        assert (advantages - ref_advantages).abs().max() < 1e-10
        assert (returns - ref_returns).abs().max() < 1e-10


def test_adaptive_lambda_gae_matches_the_reference_on_ragged_masks():
    for seed in range(3):
        rewards, values, mask = ragged(seed, T=120)
        lams = adaptive_lambda(mask, alpha=0.05)
        torch.testing.assert_close(lams.double(), torch.tensor(reference_adaptive_lambda(mask, 0.05),
                                                               dtype=torch.float64), rtol=0, atol=1e-6)
        advantages, _ = compute_gae(rewards, values, mask, 1.0, lams)
        ref_advantages, _ = reference_gae(rewards, values, mask, 1.0, lams.double().tolist())
        assert (advantages - ref_advantages).abs().max() < 1e-10


def test_a_tensor_of_equal_lambdas_equals_the_scalar_lambda():
    rewards, values, mask = ragged(5)
    scalar = compute_gae(rewards, values, mask, 0.99, 0.9)
    per_row = compute_gae(rewards, values, mask, 0.99, torch.full((mask.shape[0],), 0.9, dtype=torch.float64))
    assert torch.equal(scalar[0], per_row[0]) and torch.equal(scalar[1], per_row[1])


def test_adaptive_lambda_by_hand():
    # alpha = 0.05: 1 - 1 / (0.05 l) is 1 - 2 = -1 -> 0 at l = 10, 0 at l = 20, 0.5 at l = 40,
    # 0.8 at l = 100; an empty row gets 0
    lengths = [0, 10, 20, 40, 100]
    mask = (torch.arange(100) < torch.tensor(lengths)[:, None]).long()
    torch.testing.assert_close(adaptive_lambda(mask, 0.05), torch.tensor([0.0, 0.0, 0.0, 0.5, 0.8]))


def test_each_row_uses_its_own_lambda_by_hand():
    # gamma = 1, r = (0, 1), V = 0; lambda 0.5: A = (0.5 * 1, 1) ; lambda 0: A = (0 + V_next - V, 1) = (0, 1)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    values = torch.zeros(2, 2, dtype=torch.float64)
    advantages, _ = compute_gae(rewards, values, torch.ones(2, 2), 1.0, torch.tensor([0.5, 0.0]))
    assert advantages.tolist() == [[0.5, 1.0], [0.0, 1.0]]
