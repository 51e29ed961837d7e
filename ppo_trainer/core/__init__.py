"""The PPO algorithm as pure torch functions: no I/O, no distributed state."""

from ppo_trainer.core.gae import adaptive_lambda, compute_gae, token_rewards
from ppo_trainer.core.kl_control import AdaptiveKL, FixedKL
from ppo_trainer.core.losses import (
    AGG_MODES,
    KL_KINDS,
    PolicyLossOutput,
    ValueLossOutput,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    value_loss,
)
from ppo_trainer.core.masked import masked_mean, masked_var, masked_whiten
from ppo_trainer.core.metrics import approx_kl, clip_fraction, explained_variance, masked_stats
from ppo_trainer.core.rollout_correction import rollout_weights

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "AdaptiveKL",
    "FixedKL",
    "PolicyLossOutput",
    "ValueLossOutput",
    "adaptive_lambda",
    "aggregate",
    "approx_kl",
    "clip_fraction",
    "compute_gae",
    "entropy_from_logits",
    "explained_variance",
    "kl_penalty",
    "masked_mean",
    "masked_stats",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "rollout_weights",
    "token_rewards",
    "value_loss",
]
