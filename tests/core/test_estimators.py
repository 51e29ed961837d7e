"""The critic-free estimators (algorithm.adv_estimator grpo, rloo, reinforce_plus_plus) against
hand-computed values and slow float64 references written from verl's formulas: groups of one and
of several, masked tokens inside a response, std scaling on and off; and the switch in
core.advantages.compute that picks them."""

import math

import pytest
import torch

from ppo_trainer.config.composition import compose
from ppo_trainer.core import advantages as core_advantages
from ppo_trainer.core.estimators import (
    GRPO_EPS,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    sequence_scores,
)
from ppo_trainer.core.masked import WHITEN_EPS

NAN = float("nan")
# Two groups of two samples. Row 0 has a masked token inside its response (garbage there must not
# count), row 1 a masked tail; rows 2 and 3 score the same.
REWARDS = torch.tensor([[0.1, NAN, 0.2, 1.0],
                        [0.5, -0.5, 9.0, float("inf")],
                        [0.0, 0.0, 1.0, 0.0],
                        [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
SCORES = [1.3, 0.0, 1.0, 1.0]  # each row's rewards summed over its valid tokens


def on_valid(per_row: list[float], mask: torch.Tensor = MASK) -> torch.Tensor:
    return torch.tensor([[a if m else 0.0 for m in row] for a, row in zip(per_row, mask.tolist())], dtype=torch.float64)


def test_a_sequence_score_sums_the_token_rewards_of_valid_tokens_only():
    torch.testing.assert_close(sequence_scores(REWARDS, MASK), torch.tensor(SCORES, dtype=torch.float64))


def test_grpo_divides_by_the_groups_bessel_corrected_std_and_gives_equal_scores_zero():
    # group (1.3, 0.0): mean 0.65, unbiased std 1.3 / sqrt(2); group (1.0, 1.0): 0 / eps = 0
    half = 0.65 / (1.3 / math.sqrt(2) + GRPO_EPS)
    expected = on_valid([half, -half, 0.0, 0.0])
    torch.testing.assert_close(grpo_advantages(REWARDS, MASK, 2), expected, rtol=0, atol=1e-12)
    assert expected[0, 0].item() == pytest.approx(1 / math.sqrt(2), abs=1e-5)


def test_grpo_without_std_scaling_only_subtracts_the_group_mean():
    expected = on_valid([0.65, -0.65, 0.0, 0.0])
    torch.testing.assert_close(grpo_advantages(REWARDS, MASK, 2, norm_by_std=False), expected, rtol=0, atol=1e-12)


def test_grpo_in_a_group_of_three():
    rewards = torch.tensor([[3.0], [0.0], [0.0]], dtype=torch.float64)
    mask = torch.ones(3, 1, dtype=torch.long)
    # mean 1, unbiased std sqrt((4 + 1 + 1) / 2) = sqrt(3)
    expected = torch.tensor([[2.0], [-1.0], [-1.0]], dtype=torch.float64) / (math.sqrt(3) + GRPO_EPS)
    torch.testing.assert_close(grpo_advantages(rewards, mask, 3), expected, rtol=0, atol=1e-12)


def test_grpo_gives_a_group_of_one_mean_0_and_std_1_as_verl_does():
    scaled = grpo_advantages(REWARDS, MASK, 1)
    torch.testing.assert_close(scaled, on_valid([s / (1 + GRPO_EPS) for s in SCORES]), rtol=0, atol=1e-12)
    torch.testing.assert_close(grpo_advantages(REWARDS, MASK, 1, norm_by_std=False), on_valid(SCORES),
                               rtol=0, atol=1e-12)


def test_rloo_subtracts_the_mean_of_the_other_samples_of_the_group():
    torch.testing.assert_close(rloo_advantages(REWARDS, MASK, 2), on_valid([1.3, -1.3, 0.0, 0.0]), rtol=0, atol=1e-12)
    rewards = torch.tensor([[3.0], [0.0], [0.0]], dtype=torch.float64)
    # 3 - mean(0, 0); 0 - mean(3, 0) twice
    torch.testing.assert_close(rloo_advantages(rewards, torch.ones(3, 1), 3),
                               torch.tensor([[3.0], [-1.5], [-1.5]], dtype=torch.float64), rtol=0, atol=1e-12)


def test_rloo_leaves_a_group_of_one_its_own_score():
    torch.testing.assert_close(rloo_advantages(REWARDS, MASK, 1), on_valid(SCORES), rtol=0, atol=1e-12)


def test_rows_that_do_not_make_whole_groups_are_refused_naming_sampler_n():
    with pytest.raises(ValueError, match=r"4 rows do not split into groups of 3 .*\(sampler.n\)"):
        grpo_advantages(REWARDS, MASK, 3)


def test_reinforce_plus_plus_skips_a_masked_token_inside_a_response_and_whitens_over_the_batch():
    rewards = torch.tensor([[1.0, NAN, 2.0, 4.0], [2.0, 7.0, 7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1, 1], [1, 0, 0, 0]])
    advantages, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # row 0 from the end: 4; 2 + 0.5 * 4 = 4; the masked token is skipped: 1 + 0.5 * 4 = 3. Row 1: 2
    assert returns.tolist() == [[3.0, 0.0, 4.0, 4.0], [2.0, 0.0, 0.0, 0.0]]
    # valid returns 3, 4, 4, 2: mean 3.25, unbiased variance 2.75 / 3
    scale = (2.75 / 3 + WHITEN_EPS) ** -0.5
    expected = torch.tensor([[-0.25, 0, 0.75, 0.75], [-1.25, 0, 0, 0]], dtype=torch.float64) * scale
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


def reference_group(scores: list[float], estimator: str, norm_by_std: bool) -> list[float]:
    """One group's advantages in Python floats, as verl's core_algos writes them."""
    n = len(scores)
    if estimator == "rloo":
        return scores if n == 1 else [(s * n - sum(scores)) / (n - 1) for s in scores]
    mean = 0.0 if n == 1 else sum(scores) / n
    std = 1.0 if n == 1 else math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1))
    return [(s - mean) / (std + GRPO_EPS) if norm_by_std else s - mean for s in scores]


def reference_reinforce_plus_plus(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> list[list[float]]:
    """verl's running return, reset where the mask is 0: the same as skipping masked tokens when
    every mask is a prefix of its row."""
    returns = []
    for r, m in zip(rewards.tolist(), mask.tolist()):
        running, row = 0.0, [0.0] * len(r)
        for t in reversed(range(len(r))):
            running = r[t] * m[t] + gamma * running
            row[t] = running * m[t]
            running *= m[t]
        returns.append(row)
    return returns


@pytest.mark.parametrize("group_size", [1, 2, 5])
@pytest.mark.parametrize("estimator,norm_by_std", [("grpo", True), ("grpo", False), ("rloo", True)])
def test_grouped_estimators_match_a_slow_float64_reference(group_size, estimator, norm_by_std):
    gen = torch.Generator().manual_seed(group_size)
    rewards = torch.randn(20, 13, generator=gen, dtype=torch.float64)
    mask = (torch.rand(20, 13, generator=gen) < 0.7).long()  # masked tokens anywhere, inside responses too
    rewards = torch.where(mask.bool(), rewards, torch.tensor(NAN, dtype=torch.float64))
    scores = [sum(r for r, m in zip(row, mrow) if m) for row, mrow in zip(rewards.tolist(), mask.tolist())]
    per_row = [a for g in range(0, 20, group_size)
               for a in reference_group(scores[g:g + group_size], estimator, norm_by_std)]
    got = (grpo_advantages(rewards, mask, group_size, norm_by_std) if estimator == "grpo"
           else rloo_advantages(rewards, mask, group_size))
    assert (got - on_valid(per_row, mask)).abs().max() < 1e-12


def test_reinforce_plus_plus_matches_verls_running_return_on_prefix_masks():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, 17, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, 18, (12,), generator=gen)
    mask = (torch.arange(17) < lengths[:, None]).long()
    advantages, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.9)
    expected = torch.tensor(reference_reinforce_plus_plus(rewards, mask, 0.9), dtype=torch.float64)
    assert (returns - expected).abs().max() < 1e-12
    valid = [x for row, m in zip(expected.tolist(), mask.tolist()) for x, v in zip(row, m) if v]
    mean = sum(valid) / len(valid)
    scale = (sum((x - mean) ** 2 for x in valid) / (len(valid) - 1) + WHITEN_EPS) ** -0.5
    whitened = [[(x - mean) * scale if v else 0.0 for x, v in zip(row, m)]
                for row, m in zip(expected.tolist(), mask.tolist())]
    assert (advantages - torch.tensor(whitened, dtype=torch.float64)).abs().max() < 1e-12


def switch(estimator: str, *overrides: str):
    """core.advantages.compute with algorithm.adv_estimator=`estimator`, no critic values, on a batch
    whose token rewards are `REWARDS` (scores 0; old logprobs 0 and reference logprobs `REWARDS`
    under a k1 KL of coefficient 1 make the KL penalty exactly `REWARDS` on valid tokens)."""
    cfg = compose([f"algorithm.adv_estimator={estimator}", "sampler.n=2", "gae.kl_penalty=k1", *overrides])
    reference = torch.where(MASK.bool(), REWARDS, 0)
    return core_advantages.compute(torch.zeros(4, dtype=torch.float64), torch.zeros_like(REWARDS), reference, None,
                                   MASK, cfg.gae, cfg.algorithm, kl_coef=1.0, group_size=2)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
def test_the_switch_runs_the_estimator_on_the_token_rewards_with_the_kl_and_logs_no_critic_metric(estimator):
    out = switch(estimator, "gae.gamma=0.5")
    expected = {"grpo": lambda: (grpo_advantages(REWARDS, MASK, 2),) * 2,
                "rloo": lambda: (rloo_advantages(REWARDS, MASK, 2),) * 2,
                "reinforce_plus_plus": lambda: reinforce_plus_plus_advantages(REWARDS, MASK, 0.5)}[estimator]()
    torch.testing.assert_close(out.advantages, expected[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(out.returns, expected[1], rtol=0, atol=1e-12)
    assert sorted(out.metrics) == ["actor/kl_coef", "actor/reward_kl_penalty", "critic/advantages/mean",
                                   "critic/returns/mean", "critic/rewards/mean", "critic/score/mean"]
    assert out.metrics["critic/rewards/mean"] == pytest.approx(sum(SCORES) / 4, abs=1e-12)


def test_the_switch_leaves_gae_normalize_advantages_to_gae_and_passes_norm_adv_by_std_in_grpo():
    plain = switch("grpo", "algorithm.norm_adv_by_std_in_grpo=false")
    torch.testing.assert_close(plain.advantages, grpo_advantages(REWARDS, MASK, 2, norm_by_std=False))
    unnormalized = switch("grpo", "gae.normalize_advantages=false")
    torch.testing.assert_close(unnormalized.advantages, grpo_advantages(REWARDS, MASK, 2))
