"""The batch arithmetic of a PPO step: prompts to sequences, mini-batches and optimizer steps."""

from __future__ import annotations

from omegaconf import DictConfig


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
        "max_tokens_per_sequence": cfg.data.max_prompt_length + cfg.sampler.max_new_tokens,
        "micro_batch_token_budget": a.ppo_micro_batch_tokens,
    }


def optimizer_steps(cfg: DictConfig, role: str) -> int:
    """The cosine horizon of "actor" or "critic"; the actor sits out algorithm.critic_warmup steps."""
    warmup = cfg.algorithm.critic_warmup if role == "actor" else 0
    return batch_arithmetic(cfg)["optimizer_steps_per_ppo_step"] * max(1, cfg.trainer.total_steps - warmup)
