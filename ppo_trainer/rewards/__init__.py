"""Rewards: rule-based math scoring (math), the digit tasks' reward (digits) and reward functions
chosen by import path (loader)."""

from ppo_trainer.rewards.loader import RewardFn, load_reward_fn, score_all

__all__ = ["RewardFn", "load_reward_fn", "score_all"]
