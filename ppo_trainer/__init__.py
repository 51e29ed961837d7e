"""ppo-trainer: standard PPO for language models, driven by a Hydra config tree."""

__version__ = "0.1.0"
