"""One PPO step's advantages: token rewards, then the estimator of ``algorithm.adv_estimator`` (the
switch: `compute`): GAE with one lambda per learner and whitening, or a critic-free estimator
(``core.estimators``); metrics."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from ppo_trainer.core.estimators import grpo_advantages, reinforce_plus_plus_advantages, rloo_advantages
from ppo_trainer.core.gae import adaptive_lambda, compute_gae, token_rewards
from ppo_trainer.core.masked import masked_center, masked_mean, masked_whiten
from ppo_trainer.core.metrics import explained_variance, value_error_by_third


class Advantages(NamedTuple):
    advantages: torch.Tensor  # [B, T]; gae: after ``normalize`` (gae.normalize_advantages, advantage_std_scale)
    returns: torch.Tensor  # [B, T]; gae: the critic's targets (never whitened); the others: see `critic_free`
    sequence_kl: float  # mean over sequences of the summed per-token KL: what the KL controller sees
    metrics: dict[str, float]


def lambdas(response_mask: torch.Tensor, gae: Any, warming_up: bool) -> tuple[Any, float]:
    """One lambda per learner (VC-PPO): the policy's (gae.lam, or [B] with lam_mode=adaptive) and
    the critic's (gae.critic_lam, default gae.lam). During the critic warm-up (``warming_up``,
    `core.critic_warmup`) the critic learns Monte Carlo returns (lambda 1), which do not lean on
    its own untrained values.
    """
    policy = adaptive_lambda(response_mask, gae.adaptive_alpha) if gae.lam_mode == "adaptive" else gae.lam
    critic = 1.0 if warming_up else (gae.lam if gae.critic_lam is None else gae.critic_lam)
    return policy, critic


def normalize(advantages: torch.Tensor, response_mask: torch.Tensor, gae: Any) -> torch.Tensor:
    """[B, T] advantages as ``gae`` asks: whitened over the step's response tokens
    (``normalize_advantages``), only centred there (``advantage_std_scale=false``: OpenRLHF's
    ``no_std_norm``), or as GAE gave them. Centring removes the rewards' offset (else a batch of
    all-positive advantages raises every sampled token); dividing by the std also fixes the
    update's size whatever the rewards' scale, and so magnifies noise when they barely differ.
    """
    if not gae.normalize_advantages:
        return advantages
    if gae.advantage_std_scale:
        return masked_whiten(advantages, response_mask)
    return masked_center(advantages, response_mask)


def critic_free(estimator: str, rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float, group_size: int,
                norm_by_std: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, T] of a critic-free ``estimator`` (``core.estimators``), each with its
    own normalisation. grpo's and rloo's returns are their advantages, as verl logs them;
    reinforce_plus_plus's are its discounted returns, before whitening."""
    if estimator == "reinforce_plus_plus":
        return reinforce_plus_plus_advantages(rewards, response_mask, gamma)
    if estimator == "grpo":
        advantages = grpo_advantages(rewards, response_mask, group_size, norm_by_std)
    elif estimator == "rloo":
        advantages = rloo_advantages(rewards, response_mask, group_size)
    else:
        raise ValueError(f"algorithm.adv_estimator={estimator!r} is not a critic-free estimator")
    return advantages, advantages


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gae: Any,
                   warming_up: bool, warmup_phase: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(advantages, returns, the critic's metrics): GAE with ``lambdas``, ``normalize``.
    ``warmup_phase`` ("before" at step 1, "after" at the first step past the warm-up:
    `CriticWarmup.metric_phase`) adds critic/warmup_vf_explained_var_<phase>, the critic measured on
    Monte Carlo returns."""
    mask = response_mask
    lam, critic_lam = lambdas(mask, gae, warming_up)
    advantages, returns = compute_gae(rewards, values, mask, gae.gamma, lam)
    if gae.lam_mode == "adaptive" or critic_lam != lam:
        returns = compute_gae(rewards, values, mask, gae.gamma, critic_lam)[1]
    metrics = {"critic/values/mean": masked_mean(values, mask).item(),
               "critic/vf_explained_var": explained_variance(values, returns, mask).item(),
               **value_error_by_third(values, returns, mask)}
    if warmup_phase is not None:
        monte_carlo = returns if critic_lam == 1.0 else compute_gae(rewards, values, mask, gae.gamma, 1.0)[1]
        metrics[f"critic/warmup_vf_explained_var_{warmup_phase}"] = explained_variance(values, monte_carlo, mask).item()
    return normalize(advantages, mask, gae), returns, metrics


@torch.no_grad()
def compute(
    scores: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: Optional[torch.Tensor],
    values: Optional[torch.Tensor], response_mask: torch.Tensor, gae: Any, algorithm: Any, *, kl_coef: float,
    group_size: int, warming_up: bool = False, warmup_phase: Optional[str] = None,
    turn_rewards: Optional[torch.Tensor] = None,
) -> Advantages:
    """Token rewards (``ref_logprobs=None``: no KL), then the advantages of
    ``algorithm.adv_estimator``: ``gae`` (`gae_advantages`, from the critic's ``values``; the warm-up's
    state as `gae_advantages` takes it) or a critic-free one (`critic_free`; ``values`` None).
    ``gae``, ``algorithm``: those config sections; ``group_size``: sampler.n, the adjacent rows of
    one prompt; ``turn_rewards``: a multi-turn batch's environment rewards [B, T] (`token_rewards`).
    """
    mask = response_mask
    rewards, kl = token_rewards(scores, old_logprobs, ref_logprobs, mask, kl_coef, gae.kl_penalty, turn_rewards)
    if algorithm.adv_estimator == "gae":
        advantages, returns, critic_metrics = gae_advantages(rewards, values, mask, gae, warming_up, warmup_phase)
    else:
        advantages, returns = critic_free(algorithm.adv_estimator, rewards, mask, gae.gamma, group_size,
                                          algorithm.norm_adv_by_std_in_grpo)
        critic_metrics = {}
    metrics = {
        # the sequence's whole score: a multi-turn episode's environment rewards count (verl's meaning)
        "critic/score/mean": (scores if turn_rewards is None else scores + turn_rewards.sum(dim=1)).mean().item(),
        "critic/rewards/mean": (rewards * mask).sum(dim=1).mean().item(),
        "critic/advantages/mean": masked_mean(advantages, mask).item(),
        "critic/returns/mean": masked_mean(returns, mask).item(),
        **critic_metrics,
        "actor/reward_kl_penalty": masked_mean(kl, mask).item(),
        "actor/kl_coef": kl_coef,
    }
    return Advantages(advantages, returns, (kl * mask).sum(dim=1).mean().item(), metrics)


@torch.no_grad()
def monte_carlo_returns(scores: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: Optional[torch.Tensor],
                        response_mask: torch.Tensor, gae: Any, *, kl_coef: float,
                        turn_rewards: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, T] discounted sums of the token rewards from each token on (GAE with values 0 and lambda
    1): the returns of a step that depend on no critic, which ``critic.value_head_init=regression``
    fits the value head to before the critic's first values exist."""
    rewards, _ = token_rewards(scores, old_logprobs, ref_logprobs, response_mask, kl_coef, gae.kl_penalty,
                               turn_rewards)
    return compute_gae(rewards, torch.zeros_like(rewards), response_mask, gae.gamma, 1.0)[1]
