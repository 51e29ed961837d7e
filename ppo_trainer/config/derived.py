"""What a config implies without spelling it: where the KL penalty goes, whether the run needs the
reference model, a critic or the data's answers, and the batch arithmetic of a PPO step (prompts to
sequences, mini-batches and optimizer steps). The one place each is decided."""

from __future__ import annotations

from typing import Any, Optional

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


def uses_critic(cfg: DictConfig) -> bool:
    """Whether the run builds a critic: GAE needs its values; every other algorithm.adv_estimator is
    critic-free (no critic role, phases, checkpoint part or metrics)."""
    return cfg.algorithm.adv_estimator == "gae"


def trained_roles(cfg: DictConfig) -> tuple[str, ...]:
    """The roles whose weights the run trains and checkpoints: the actor, and the critic where it is built."""
    return ("actor", "critic") if uses_critic(cfg) else ("actor",)


def is_multi_turn(sampler: Any) -> bool:
    """Whether rollouts are multi-turn: an environment or tools answer the policy (docs/multi-turn.md).
    `sampler`: the config's sampler section."""
    mt = sampler.multi_turn
    return mt.env is not None or len(mt.tools) > 0


def response_budget(sampler: Any, max_new_tokens: Optional[int] = None) -> int:
    """The longest response block in tokens with `max_new_tokens` per turn (None: sampler.max_new_tokens;
    validation's is eval.max_new_tokens): that, or a multi-turn episode's sampler.multi_turn.max_response_tokens
    (None: max_turns x (max_new_tokens + max_observation_tokens)). `sampler`: the config's sampler section."""
    mt = sampler.multi_turn
    per_turn = sampler.max_new_tokens if max_new_tokens is None else max_new_tokens
    if not is_multi_turn(sampler):
        return per_turn
    return mt.max_response_tokens or mt.max_turns * (per_turn + mt.max_observation_tokens)


def batch_arithmetic(cfg: DictConfig) -> dict[str, int]:
    """Counts per PPO step: the one place that turns prompts into sequences and optimizer steps."""
    prompts, n, a = cfg.data.train_batch_size, cfg.sampler.n, cfg.algorithm
    mini_batches = prompts // a.ppo_mini_batch_size
    return {
        "prompts_per_step": prompts,
        "sequences_per_step": prompts * n,
        "sequences_per_mini_batch": a.ppo_mini_batch_size * n,
        "mini_batches_per_epoch": mini_batches,
        "optimizer_steps_per_ppo_step": mini_batches * a.ppo_epochs,
        "critic_optimizer_steps_per_ppo_step": mini_batches * critic_epochs(cfg),
        "max_tokens_per_sequence": cfg.data.max_prompt_length + response_budget(cfg.sampler),
        "micro_batch_token_budget": a.ppo_micro_batch_tokens,
    }


def critic_epochs(cfg: DictConfig) -> int:
    """The critic's passes over a step's rollouts: critic.ppo_epochs, else algorithm.ppo_epochs."""
    return cfg.algorithm.ppo_epochs if cfg.critic.ppo_epochs is None else cfg.critic.ppo_epochs


def optimizer_steps(cfg: DictConfig, role: str) -> int:
    """The cosine horizon of "actor" or "critic". The actor sits out the critic warm-up:
    algorithm.critic_warmup steps, or with critic_warmup_explained_var at least its first step (the
    end is known only as it comes: the horizon assumes the earliest, so the schedule never reaches
    its floor before the run's last step)."""
    sizes, a = batch_arithmetic(cfg), cfg.algorithm
    if role == "critic":
        return sizes["critic_optimizer_steps_per_ppo_step"] * cfg.trainer.total_steps
    warmup = min(a.critic_warmup, 1) if a.critic_warmup_explained_var is not None else a.critic_warmup
    return sizes["optimizer_steps_per_ppo_step"] * max(1, cfg.trainer.total_steps - warmup)
