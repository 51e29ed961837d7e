"""compute_gae, token_rewards and masked_whiten against hand-computed numbers and a slow reference."""

import pytest
import torch

from ppo_trainer.core.gae import compute_gae, token_rewards
from ppo_trainer.core.masked import masked_mean, masked_var, masked_whiten


def reference_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE, one sequence and one token at a time, in float64, on the valid tokens only;
    `lam` is one number or a list with one lambda per sequence."""
    advantages = torch.zeros(rewards.shape, dtype=torch.float64)
    lams = lam if isinstance(lam, list) else [lam] * rewards.shape[0]
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_value = float(values[b, steps[k + 1]]) if k + 1 < len(steps) else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lams[b] * running
            advantages[b, t] = running
    returns = torch.where(mask.bool(), advantages + values.double(), 0)
    return advantages, returns


def ragged_batch(batch, length, seed, right_padded=True, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=dtype)
    values = torch.randn(batch, length, generator=gen, dtype=dtype)
    if right_padded:
        lengths = torch.randint(0, length + 1, (batch,), generator=gen)
        mask = (torch.arange(length) < lengths[:, None]).long()
    else:
        mask = (torch.rand(batch, length, generator=gen) < 0.6).long()
    return rewards, values, mask


@pytest.mark.parametrize("right_padded", [True, False], ids=["right-padded", "arbitrary-mask"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.8)])
def test_gae_matches_slow_reference_on_ragged_masks(right_padded, gamma, lam):
    for seed in range(3):
        rewards, values, mask = ragged_batch(16, 37, seed, right_padded)
        advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
        ref_advantages, ref_returns = reference_gae(rewards, values, mask, gamma, lam)
        assert (advantages - ref_advantages).abs().max() < 1e-6
        assert (returns - ref_returns).abs().max() < 1e-6


def test_gae_float32_matches_float64_reference():
    rewards, values, mask = ragged_batch(8, 64, seed=7, dtype=torch.float32)
    advantages, _ = compute_gae(rewards, values, mask, 0.99, 0.95)
    ref_advantages, _ = reference_gae(rewards, values, mask, 0.99, 0.95)
    assert advantages.dtype == torch.float32
    assert (advantages.double() - ref_advantages).abs().max() < 1e-5


def test_gae_one_step_by_hand():
    # delta = r + gamma * 0 - V = 1 - 0.5; nothing follows, so A = delta and R = A + V = r.
    advantages, returns = compute_gae(
        torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[1]]), gamma=0.9, lam=0.95
    )
    assert advantages.tolist() == [[0.5]]
    assert returns.tolist() == [[1.0]]


def test_gae_three_steps_by_hand_with_ragged_padding():
    # gamma = lam = 0.5, row 0: r = (0, 0, 1), V = (0.1, 0.2, 0.3), then two padding tokens.
    #   t=2: delta = 1 + 0.5*0   - 0.3 =  0.7     A = 0.7
    #   t=1: delta = 0 + 0.5*0.3 - 0.2 = -0.05    A = -0.05 + 0.25*0.7   = 0.125
    #   t=0: delta = 0 + 0.5*0.2 - 0.1 =  0.0     A =  0.0  + 0.25*0.125 = 0.03125
    # row 1: one token, r = 2, V = 0.5: A = 1.5, R = 2.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0, 5.0], [2.0, 9.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
    values = torch.tensor([[0.1, 0.2, 0.3, 7.0, 7.0], [0.5, 3.0, 3.0, 3.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    expected_advantages = torch.tensor([[0.03125, 0.125, 0.7, 0, 0], [1.5, 0, 0, 0, 0]], dtype=torch.float64)
    expected_returns = torch.tensor([[0.13125, 0.325, 1.0, 0, 0], [2.0, 0, 0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected_advantages, rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, expected_returns, rtol=0, atol=1e-12)


def test_gae_with_gamma_and_lambda_one_gives_reward_to_go():
    rewards, values, mask = ragged_batch(6, 20, seed=3)
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    masked_rewards = rewards * mask
    reward_to_go = masked_rewards.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(returns, reward_to_go, rtol=0, atol=1e-12)
    torch.testing.assert_close(advantages, (reward_to_go - values) * mask, rtol=0, atol=1e-12)


def test_gae_bootstraps_zero_after_the_last_valid_token():
    # Whatever the critic says after the response ends must not leak into the last token.
    rewards = torch.tensor([[0.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    for padded_value in (0.0, 1e6, -1e6):
        values = torch.tensor([[1.0, 2.0, padded_value]])
        advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
        assert advantages[0, 1].item() == pytest.approx(3.0 - 2.0)
        assert returns[0].tolist() == [3.0, 3.0, 0.0]


def test_gae_is_invariant_to_appended_padding():
    rewards, values, mask = ragged_batch(5, 12, seed=11)
    advantages, returns = compute_gae(rewards, values, mask, 0.97, 0.9)
    garbage = torch.randn(5, 7, dtype=torch.float64) * 1e3
    padded = compute_gae(
        torch.cat([rewards, garbage], 1),
        torch.cat([values, garbage.flip(0)], 1),
        torch.cat([mask, torch.zeros(5, 7, dtype=mask.dtype)], 1),
        0.97,
        0.9,
    )
    assert torch.equal(padded[0][:, :12], advantages) and torch.equal(padded[1][:, :12], returns)
    assert not padded[0][:, 12:].any() and not padded[1][:, 12:].any()


def test_gae_skips_interior_masked_tokens_as_if_removed():
    # Row (r=1, V=0.5), hole, (r=2, V=1.0); gamma = lam = 1:
    #   last:  A = 2 - 1.0 = 1.0 ; first: delta = 1 + 1.0 - 0.5 = 1.5, A = 1.5 + 1.0 = 2.5
    rewards = torch.tensor([[1.0, 99.0, 2.0]])
    values = torch.tensor([[0.5, 99.0, 1.0]])
    advantages, returns = compute_gae(rewards, values, torch.tensor([[1, 0, 1]]), 1.0, 1.0)
    assert advantages.tolist() == [[2.5, 0.0, 1.0]]
    assert returns.tolist() == [[3.0, 0.0, 2.0]]


def test_gae_of_all_masked_row_is_zero():
    advantages, returns = compute_gae(torch.ones(2, 4), torch.ones(2, 4), torch.zeros(2, 4), 0.99, 0.95)
    assert not advantages.any() and not returns.any()


def test_token_rewards_put_score_on_last_valid_token_of_ragged_rows():
    # k1 KL = old - ref; reward = -0.5 * KL, plus the score on the last valid token.
    scores = torch.tensor([1.0, -0.5])
    old = torch.tensor([[0.1, 0.2, 0.3], [0.0, -0.4, 9.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, 0.0, 0.0], [0.2, 0.1, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, kl = token_rewards(scores, old, ref, mask, kl_coef=0.5, kl_penalty="k1")
    expected_kl = torch.tensor([[0.1, 0.2, 0.3], [-0.2, -0.5, 0.0]], dtype=torch.float64)
    expected_rewards = torch.tensor([[-0.05, -0.1, 0.85], [0.1, -0.25, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(kl, expected_kl, rtol=0, atol=1e-12)
    torch.testing.assert_close(rewards, expected_rewards, rtol=0, atol=1e-12)


def test_token_rewards_without_reference_are_the_score_alone():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]])
    rewards, kl = token_rewards(torch.tensor([2.0, 3.0, 4.0]), torch.randn(3, 4), None, mask, 0.1, "k1")
    assert rewards.tolist() == [[0, 2.0, 0, 0], [0, 0, 0, 0], [0, 0, 4.0, 0]]
    assert not kl.any()


def test_token_rewards_use_the_named_kl_kind():
    old, ref = torch.tensor([[0.0, -3.0]]), torch.tensor([[-1.0, -1.0]])
    rewards, kl = token_rewards(torch.tensor([0.0]), old, ref, torch.tensor([[1, 1]]), 1.0, "abs")
    assert kl.tolist() == [[1.0, 2.0]]
    assert rewards.tolist() == [[-1.0, -2.0]]


def test_masked_mean_and_var_ignore_masked_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 1e9], [4.0, float("nan"), float("inf"), 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert masked_mean(x, mask).item() == 2.5  # (1 + 2 + 3 + 4) / 4
    assert masked_mean(x, mask, dim=1).tolist() == [2.0, 4.0]
    assert masked_var(x, mask).item() == pytest.approx(5.0 / 3.0)  # squares 2.25+0.25+0.25+2.25
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(1.25)


def test_masked_whiten_gives_zero_mean_unit_variance_on_valid_tokens_and_zero_padding():
    x = torch.tensor([[1.0, 2.0, 3.0, 50.0], [4.0, -7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    whitened = masked_whiten(x, mask)
    # valid values 1, 2, 3, 4: mean 2.5, unbiased var 5/3
    expected = (torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5) / (5.0 / 3.0 + 1e-8) ** 0.5
    torch.testing.assert_close(whitened[mask.bool()], expected)
    assert whitened[~mask.bool()].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert masked_mean(whitened, mask).abs().item() < 1e-6
    assert masked_var(whitened, mask).item() == pytest.approx(1.0, abs=1e-6)
