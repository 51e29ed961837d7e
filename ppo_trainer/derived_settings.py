"""What a config implies without spelling it: where the KL penalty goes, whether the run needs the
reference model or the data's answers. The one place each is decided."""

from __future__ import annotations

from omegaconf import DictConfig


def kl_in_reward(cfg: DictConfig) -> bool:
    """The one place that resolves algorithm.use_kl_in_reward=None (not use_kl_loss); needs gae.kl_coef > 0."""
    a = cfg.algorithm
    routed = (not a.use_kl_loss) if a.use_kl_in_reward is None else a.use_kl_in_reward
    return bool(routed) and cfg.gae.kl_coef > 0


def uses_ground_truth(cfg: DictConfig) -> bool:
    """Whether a configured reward reads the data's answers: a reward function does (training's or
    validation's); a reward model does not, and a reward server gets them when there are some."""
    return cfg.reward.fn is not None or cfg.eval.reward_fn is not None


def uses_reference(cfg: DictConfig) -> bool:
    """Whether the run builds the reference policy: for a KL in the reward or in the loss."""
    return kl_in_reward(cfg) or cfg.algorithm.use_kl_loss
