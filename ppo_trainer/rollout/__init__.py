"""Rollout engines: a prompt Batch in, n sampled responses per prompt out (see `base`).

vLLM and transformers' model code load only when a sampler is built (`workers.roles.build_rollout`).
"""

from ppo_trainer.rollout.base import Sampler, logprob_gap_metrics, prompts_to_batch
from ppo_trainer.rollout.hf import HFSampler
from ppo_trainer.rollout.vllm import VllmSampler, check_vllm_available

__all__ = ["HFSampler", "Sampler", "VllmSampler", "check_vllm_available", "logprob_gap_metrics", "prompts_to_batch"]
