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
