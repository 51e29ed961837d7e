"""Prompt data: loading and filtering (datasets), GSM8K conventions (gsm8k), the built-in
arithmetic generator (arithmetic) and the resumable prompt loader (loader)."""

from ppo_trainer.data.datasets import DataError, PromptRecord, load_prompts
from ppo_trainer.data.loader import PromptLoader

__all__ = ["DataError", "PromptLoader", "PromptRecord", "load_prompts"]
