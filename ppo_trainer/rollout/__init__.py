"""Rollout engines (see `base`); vLLM and transformers' model code load only when one is built."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ppo_trainer.config.derived import is_multi_turn, response_budget
from ppo_trainer.config.schema import SamplerConfig
from ppo_trainer.rollout.base import PartialSampler, Sampler, prompts_to_batch
from ppo_trainer.rollout.hf import HFSampler
from ppo_trainer.rollout.multi_turn import MultiTurnSampler, episodes_factory, multi_turn_metrics
from ppo_trainer.rollout.vllm import VllmSampler, check_vllm_available
from ppo_trainer.rollout.vllm_partial import PartialVllmSampler

__all__ = ["HFSampler", "MultiTurnSampler", "PartialSampler", "PartialVllmSampler", "Sampler", "VllmSampler",
           "build_sampler", "check_vllm_available", "multi_turn_metrics", "prompts_to_batch"]


def build_sampler(cfg: SamplerConfig, model_dir: str | Path, *, dtype: str = "bfloat16", seed: int = 0,
                  max_prompt_length: Optional[int] = None, colocate: bool = False, device: str = "cpu",
                  trust_remote_code: bool = False, chat_template_kwargs: Optional[dict] = None) -> Sampler:
    """The `cfg.name` sampler on its own copy of `model_dir`, inside a `MultiTurnSampler` when an
    environment or tools answer the policy (`cfg.multi_turn`). vllm: sleep mode when `colocate`; with
    `cfg.partial_rollouts` the engine whose generation continues across weight syncs (`vllm_partial`);
    `max_prompt_length` + the response block (cfg.max_new_tokens, or multi-turn the whole
    `response_budget`) bounds its context unless `cfg.vllm.max_model_len` is set."""
    multi_turn = is_multi_turn(cfg)
    if cfg.name == "hf":
        inner = HFSampler(model_dir, cfg, batch_size=cfg.generate_batch_size, dtype=dtype, device=device,
                          trust_remote_code=trust_remote_code)
        tokenizer = inner.tokenizer
    else:
        max_model_len = None if max_prompt_length is None else max_prompt_length + response_budget(cfg)
        if cfg.partial_rollouts:
            inner = PartialVllmSampler(model_dir, cfg, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                       trust_remote_code=trust_remote_code)
        else:
            inner = VllmSampler(model_dir, cfg, dtype=dtype, seed=seed, enable_sleep=colocate,
                                trust_remote_code=trust_remote_code, max_model_len=max_model_len)
        tokenizer = inner.llm.get_tokenizer()
    if not multi_turn:
        return inner
    return MultiTurnSampler(inner, cfg, tokenizer, episodes_factory(cfg, tokenizer, chat_template_kwargs))
