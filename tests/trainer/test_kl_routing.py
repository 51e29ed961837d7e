"""Where the KL to the reference goes: the reward (gae.kl_coef), the loss (algorithm.use_kl_loss),
both only when algorithm.use_kl_in_reward says so, or nowhere; and what needs the reference."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.batch import Batch
from ppo_trainer.config.composition import compose
from ppo_trainer.config.derived import kl_in_reward, uses_reference
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.data import PromptRecord
from ppo_trainer.plan.dry_run import describe_plan
from ppo_trainer.trainer import Trainer

ROUTES = {  # overrides -> (KL in the reward, KL in the loss, the plan's word)
    (): (True, False, "reward"),
    ("algorithm.use_kl_loss=true",): (False, True, "loss"),
    ("algorithm.use_kl_loss=true", "algorithm.use_kl_in_reward=true"): (True, True, "both"),
    ("algorithm.use_kl_in_reward=false",): (False, False, "nowhere"),
    ("gae.kl_coef=0",): (False, False, "nowhere"),
}


def smoke_cfg(*overrides: str):
    return compose(["+experiment=smoke", *overrides])


def trainer_without_workers(cfg) -> Trainer:
    record = PromptRecord(index=0, question="q", prompt="q", prompt_ids=(1, 2), ground_truth="1", data_source="q")
    return Trainer(cfg, {"actor": None, "critic": None, "rollout": None}, 0, [record], [])


def scored_batch() -> Batch:
    """Two rows of 3 response tokens; the second row has 2. The policy is log 2 away from the
    reference on every token, so the k1 penalty is 0.693 per token."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old = torch.full((2, 3), -1.0)
    return Batch(
        input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.long),
        position_ids=torch.arange(5).repeat(2, 1), response_mask=mask, old_logprobs=old,
        ref_logprobs=old - torch.log(torch.tensor(2.0)), values=torch.zeros(2, 3), scores=torch.tensor([1.0, 0.0]),
        truncated=torch.tensor([False, False]),
    )


@pytest.mark.parametrize("overrides", list(ROUTES), ids=lambda o: " ".join(o) or "default")
def test_the_kl_reaches_the_reward_only_when_the_config_routes_it_there(overrides):
    in_reward, in_loss, _ = ROUTES[overrides]
    # gamma = lam = 1 and zero values: each advantage is the sum of the token rewards from its
    # token on, so the advantages pin down the token rewards exactly
    cfg = smoke_cfg("gae.normalize_advantages=false", "gae.gamma=1.0", "gae.lam=1.0", *overrides)
    assert kl_in_reward(cfg) == in_reward
    assert cfg.algorithm.use_kl_loss == in_loss
    batch, metrics = trainer_without_workers(cfg).compute_advantages(scored_batch(), step=1)
    expected = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    if in_reward:
        expected -= cfg.gae.kl_coef * torch.log(torch.tensor(2.0)) * batch.response_mask
    torch.testing.assert_close(batch.advantages, expected.flip(1).cumsum(1).flip(1))
    assert metrics["actor/kl_coef"] == (cfg.gae.kl_coef if in_reward else 0.0)


@pytest.mark.parametrize("overrides", list(ROUTES), ids=lambda o: " ".join(o) or "default")
def test_the_reference_is_built_when_either_kl_needs_it_and_the_plan_says_where_the_kl_goes(overrides):
    in_reward, in_loss, word = ROUTES[overrides]
    cfg = smoke_cfg(*overrides)
    assert uses_reference(cfg) == (in_reward or in_loss)
    plan = describe_plan(cfg, [])
    assert f"kl:        {word}" in plan


def test_the_adaptive_controller_of_a_kl_not_in_the_reward_is_rejected():
    with pytest.raises(ConfigError, match="gae.kl_ctrl"):
        smoke_cfg("gae.kl_ctrl=adaptive", "algorithm.use_kl_loss=true")


def test_a_kl_in_the_reward_with_coefficient_zero_is_rejected():
    with pytest.raises(ConfigError, match="algorithm.use_kl_in_reward"):
        smoke_cfg("algorithm.use_kl_in_reward=true", "gae.kl_coef=0")
