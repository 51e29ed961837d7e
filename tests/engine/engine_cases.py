"""Shared by the engine tests and the 2-rank worker: batches, configs and one-step routines.

Everything here runs identically in the pytest process (a 1-rank group) and in each rank of the
distributed worker, so the two can be compared number for number.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ppo_trainer.batch import Batch
from ppo_trainer.config.schema import AlgorithmConfig, CriticConfig, ModelConfig, OptimConfig
from ppo_trainer.engine.actor import ActorEngine
from ppo_trainer.engine.critic import CriticEngine

VOCAB = 100  # the tiny model's vocabulary is a little larger; ids 3.. are plain characters
LR = 1e-4

# Uneven rows: ranks and micro-batches get different token counts.
PROMPT_LENS = [3, 5, 2, 4, 6, 3, 2, 5]
RESPONSE_LENS = [12, 2, 3, 4, 2, 5, 1, 3]
SMALL_BUDGET = 16  # several micro-batches per rank; the longest row (3 + 12 tokens) fits alone
BIG_BUDGET = 10_000  # one micro-batch


def random_batch(prompt_lens: list[int], response_lens: list[int], seed: int = 0, samples: int = 1) -> Batch:
    """Left-padded prompts, right-padded responses, random ids; advantages, returns, values,
    old/ref logprobs filled with random numbers on real response tokens (0 elsewhere). With
    `samples` > 1, each run of `samples` rows shares the prompt of its first row (a prompt's samples)."""
    gen = torch.Generator().manual_seed(seed)
    B, P, T = len(prompt_lens), max(prompt_lens), max(response_lens)
    ids = torch.zeros(B, P + T, dtype=torch.long)
    attn = torch.zeros(B, P + T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        first = i - i % samples
        p = prompt_lens[first]
        ids[i, P - p : P + r] = torch.randint(3, VOCAB, (p + r,), generator=gen)
        ids[i, P - p : P] = ids[first, P - p : P]
        attn[i, P - p : P + r] = 1
    mask = attn[:, P:].clone()

    def noise(scale: float) -> torch.Tensor:
        return torch.randn(B, T, generator=gen) * scale * mask

    return Batch(
        input_ids=ids,
        attention_mask=attn,
        position_ids=(attn.cumsum(1) - 1).clamp(min=0),
        response_mask=mask,
        advantages=noise(1.0),
        returns=noise(1.0),
        values=noise(0.1),
        old_logprobs=noise(0.1) - 4.6 * mask,
        ref_logprobs=noise(0.1) - 4.6 * mask,
    )


def algorithm(budget: int = SMALL_BUDGET, **overrides) -> AlgorithmConfig:
    return AlgorithmConfig(**{"ppo_micro_batch_tokens": budget, "shuffle_mini_batches": False, **overrides})


def model_config(model_dir: str | Path, **overrides) -> ModelConfig:
    return ModelConfig(**{"path": str(model_dir), "dtype": "float32", "optim": OptimConfig(lr=LR), **overrides})


def make_actor(model_dir, budget: int = SMALL_BUDGET, mini_batch_size: int = 8, **overrides) -> ActorEngine:
    alg = algorithm(budget, **overrides.pop("algorithm", {}))
    return ActorEngine(model_config(model_dir, **overrides), model_dir, alg, mini_batch_size=mini_batch_size,
                       temperature=0.7)


def make_critic(model_dir, budget: int = SMALL_BUDGET, mini_batch_size: int = 8, **overrides) -> CriticEngine:
    alg = algorithm(budget, **overrides.pop("algorithm", {}))
    return CriticEngine(CriticConfig(dtype="float32", optim=OptimConfig(lr=LR), **overrides), model_dir, alg,
                        mini_batch_size=mini_batch_size)


def full_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded gradients by parameter name (a collective call)."""
    out = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            # clone: on one rank full_tensor() may return the gradient itself, which clipping rescales
            out[name] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
    return out


def one_step(engine, batch: Batch, budget: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """Gradients of the whole batch as one mini-batch, then one optimizer step.

    `engine` is an ActorEngine or CriticEngine. Returns (full gradients, full state dict after
    the step as `engine.full_state_dict()` gives it (rank 0; {} elsewhere), statistics).
    """
    stats = engine.backward_mini_batch(batch, engine.micro_batch_loss, budget)
    grads = full_grads(engine.module)
    stats.update(engine.optimizer_step())
    return grads, engine.full_state_dict(), stats


def naive_logprobs(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """[B, T] response logprobs from a plain transformers model's full logits."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float() / temperature
    P = batch.prompt_length
    logp = torch.log_softmax(logits[:, P - 1 : -1], -1).gather(-1, batch.response_ids[..., None])[..., 0]
    return logp * batch.response_mask
