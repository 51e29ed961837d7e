"""Prompt data: loading, filtering and prompt format (datasets), the built-in generators
(arithmetic, digits) and the resumable prompt loader (loader)."""

from ppo_trainer.data.datasets import DataError, PromptRecord, load_prompts
from ppo_trainer.data.loader import PromptLoader

__all__ = ["DataError", "PromptLoader", "PromptRecord", "load_prompts"]
