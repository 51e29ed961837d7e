"""Fixtures of the rollout tests: the tiny model, an EOS-prone variant, one vLLM engine per session.

The vLLM engine is expensive to start, so one engine (float32, in-process) serves every test;
each test pushes the weights it needs (`load_weight_bucket`, `finish_weight_sync`) and sets the sampling settings it
needs on `sampler.cfg`, so tests do not depend on their order.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Iterator

import pytest
import torch

from ppo_trainer.batch import Batch
from ppo_trainer.config.schema import SamplerConfig, VllmConfig
from ppo_trainer.rollout import prompts_to_batch

MAX_NEW_TOKENS = 12
EOS_PROBABILITY = 0.1  # per step, in the EOS-prone model: ~28% of 12-token responses run out
# Sampling settings a model's generation_config.json may carry; no sampler may apply them.
LEAKY_GENERATION_CONFIG = dict(
    do_sample=True, temperature=0.3, top_k=3, top_p=0.5, min_p=0.2, repetition_penalty=1.8, no_repeat_ngram_size=1,
    suppress_tokens=[5, 6, 7], begin_suppress_tokens=[8, 9], bad_words_ids=[[10], [11]],
    sequence_bias=[[[12], -5.0]], max_new_tokens=2,
)


def sampler_config(**overrides) -> SamplerConfig:
    """Float32-friendly test settings: short responses, a small CPU KV cache, eager engine; contexts
    of up to 320 tokens (more than two of the CPU build's 128-token KV blocks, for prefix caching)."""
    base = SamplerConfig(
        max_new_tokens=MAX_NEW_TOKENS,
        vllm=VllmConfig(max_model_len=320, enforce_eager=True, kv_cache_gb=0.0625),
    )
    return dataclasses.replace(base, **overrides)


def load_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def eos_prone_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tiny model's weights changed so that EOS has a fixed chance of about EOS_PROBABILITY per step.

    Residual dimension 0 becomes a constant: every embedding holds 1.0 there and no attention or
    MLP output writes to it. After the final norm it is a near-constant feature, and the EOS row
    of lm_head reads it with a weight that lifts the EOS logit over the (near-uniform) rest.
    """
    model = load_model(model_dir)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.embed_tokens.weight"][:, 0] = 1.0
    for name, tensor in state.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor[0, :] = 0.0
    vocab = model.config.vocab_size
    eos = model.config.eos_token_id
    target_logit = torch.log(torch.tensor(EOS_PROBABILITY * (vocab - 1) / (1 - EOS_PROBABILITY))).item()
    model.load_state_dict(state)
    with torch.no_grad():
        hidden = model(torch.arange(vocab).unsqueeze(0), output_hidden_states=True).hidden_states[-1]
    feature = hidden[0, :, 0].mean().item()  # the constant dimension after the final norm
    state["lm_head.weight"][eos] = 0.0
    state["lm_head.weight"][eos, 0] = target_logit / feature
    return state


def with_leaky_generation_config(model_dir: Path, folder: Path) -> Path:
    """A copy of `model_dir` in `folder` whose generation_config.json adds LEAKY_GENERATION_CONFIG."""
    import json

    shutil.copytree(model_dir, folder, dirs_exist_ok=True)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **LEAKY_GENERATION_CONFIG}))
    return folder


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def eos_state(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return eos_prone_state_dict(tiny_model_dir)


@pytest.fixture(scope="session")
def eos_model_dir(tiny_model_dir: Path, eos_state, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model folder holding the EOS-prone weights."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("tiny-eos")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    save_file({k: v.contiguous() for k, v in eos_state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def prompts(tokenizer) -> Batch:
    """Three chat prompts of different lengths (so left padding is exercised)."""
    questions = ["What is 2 + 3?", "Hi", "Count the apples: 7 and 5, how many?"]
    ids = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        for q in questions
    ]
    return prompts_to_batch(
        ids, tokenizer.pad_token_id, prompt_text=questions, ground_truth=["5", "", "12"]
    )


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One float32 vLLM engine for the whole session (skips where vLLM is not installed), built
    from the tiny model with LEAKY_GENERATION_CONFIG, so every vLLM test also checks that the
    model's generation_config.json does not reach the samples (one in-process engine per
    process: a second one tears down the first's distributed state when it is collected)."""
    from ppo_trainer.rollout import check_vllm_available

    problem = check_vllm_available()
    if problem:
        pytest.skip(problem)
    from ppo_trainer.rollout.vllm import VllmSampler

    folder = with_leaky_generation_config(tiny_model_dir, tmp_path_factory.mktemp("tiny-leaky"))
    return VllmSampler(folder, sampler_config(), dtype="float32", seed=0)


@pytest.fixture
def vllm_sampler(vllm_engine) -> Iterator:
    """The session engine with the default test settings restored after the test."""
    yield vllm_engine
    vllm_engine.cfg = sampler_config()


def reference_logprobs(model, batch: Batch, temperature: float) -> torch.Tensor:
    """[B, T] log_softmax(logits / temperature) of the response tokens, by a plain forward; 0 on padding.

    The logits at column P+t-1 predict response token t.
    """
    P, T = batch.prompt_length, batch.response_length
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits.float()
    logprobs = torch.log_softmax(logits[:, P - 1 : P + T - 1] / temperature, dim=-1)
    token_logprobs = logprobs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    return token_logprobs * batch.response_mask
