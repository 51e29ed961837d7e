"""Multi-turn response blocks: observation tokens between the policy's turns (response_mask 0
inside the block, not only at its end) carry no token reward, KL, advantage, return, loss,
entropy bonus or gradient, whatever the other tensors hold there."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ppo_trainer.config.schema import AlgorithmConfig, GaeConfig
from ppo_trainer.core import advantages as core_advantages
from ppo_trainer.core.losses import actor_loss

# two episodes: action, observation, action (row 0); action, observation cut at the block's end (row 1)
MASK = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]])
OBSERVATION = (MASK == 0) & torch.tensor([[True] * 6, [True] * 5 + [False]])


def tensors(garbage: float) -> dict[str, torch.Tensor]:
    """Seeded per-token tensors [2, 6] holding `garbage` on the observation tokens."""
    gen = torch.Generator().manual_seed(0)
    names = ("logprobs", "old", "ref", "values", "entropy", "advantages")
    return {n: torch.where(MASK.bool(), -torch.rand(2, 6, generator=gen), garbage) for n in names}


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_observation_tokens_get_no_reward_kl_advantage_or_return(estimator):
    algorithm = AlgorithmConfig(adv_estimator=estimator)
    out = {}
    for garbage in (0.0, 1e3):
        t = tensors(garbage)
        out[garbage] = core_advantages.compute(torch.tensor([1.0, -1.0]), t["old"], t["ref"],
                                               t["values"] if estimator == "gae" else None, MASK, GaeConfig(),
                                               algorithm, kl_coef=0.1, group_size=2)
        assert not out[garbage].advantages[OBSERVATION].any() and not out[garbage].returns[OBSERVATION].any()
    assert torch.equal(out[0.0].advantages, out[1e3].advantages) and out[0.0].sequence_kl == out[1e3].sequence_kl


def test_the_actor_loss_and_its_gradients_ignore_observation_tokens():
    """Policy loss, entropy bonus and KL loss together: the same loss with garbage on the
    observations, and no gradient into them."""
    algorithm = dataclasses.replace(AlgorithmConfig(), entropy_coef=0.01, use_kl_loss=True)
    results = []
    for garbage in (0.0, 1e3):
        t = tensors(garbage)
        logprobs, entropy = t["logprobs"].requires_grad_(True), t["entropy"].requires_grad_(True)
        loss, _ = actor_loss(logprobs, entropy, t["old"] + 0.1, t["advantages"], MASK, t["ref"], None, algorithm,
                             global_tokens=float(MASK.sum()), global_seqs=2.0)
        loss.backward()
        assert not logprobs.grad[OBSERVATION].any() and not entropy.grad[OBSERVATION].any()
        results.append((loss.detach(), logprobs.grad, entropy.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_gae_over_a_two_turn_episode_matches_the_hand_computed_float64_reference():
    """Action a1 a2, observation o o, action b1 b2; the environment rewards the first turn 0.5 (on
    a2) and the second 1.0 (on b2), the reward function scores the episode 0.2 (on its last token).
    gamma 1, lambda 0.9, no KL. The assistant's tokens a1 a2 b1 b2 are GAE's steps, b1 following a2:
        deltas  b2: 1.2 - 0.4 = 0.8   b1: 0 + 0.4 - 0.3 = 0.1   a2: 0.5 + 0.3 - 0.2 = 0.6   a1: 0.2 - 0.1 = 0.1
        A       b2: 0.8   b1: 0.1 + 0.9 x 0.8 = 0.82   a2: 0.6 + 0.9 x 0.82 = 1.338   a1: 0.1 + 0.9 x 1.338 = 1.3042
    and the returns A + V: 1.4042, 1.538, 1.12, 1.2."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4]], dtype=torch.float64)  # 9: never read
    turn_rewards = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    logprobs = torch.zeros(1, 6, dtype=torch.float64)
    gae = dataclasses.replace(GaeConfig(), gamma=1.0, lam=0.9, normalize_advantages=False)
    out = core_advantages.compute(torch.tensor([0.2], dtype=torch.float64), logprobs, None, values, mask, gae,
                                  AlgorithmConfig(), kl_coef=0.0, group_size=1, turn_rewards=turn_rewards)
    expected = torch.tensor([[1.3042, 1.338, 0.0, 0.0, 0.82, 0.8]], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.returns, torch.tensor([[1.4042, 1.538, 0.0, 0.0, 1.12, 1.2]], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert out.metrics["critic/score/mean"] == pytest.approx(1.7)  # the function's 0.2 and the turns' 1.5
