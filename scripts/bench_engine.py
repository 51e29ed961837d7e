"""Throughput of the training engine: one actor update and one critic update (and their forwards).

    python scripts/bench_engine.py                      # small random Llama, CPU, float32
    python scripts/bench_engine.py --dtype bfloat16 --rows 32 --response-len 128
    python scripts/bench_engine.py --model-dir PATH --device cuda

Runs in one process (a 1-rank FSDP2 group). Each measurement is taken after one untimed warm-up
call. Tokens are real (unpadded) prompt + response tokens; an update processes them
`--ppo-epochs` times.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def build_model(folder: Path, hidden: int, layers: int, vocab: int, seed: int) -> Path:
    """A random Llama causal LM (float32) in `folder`; no tokenizer needed by the engine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def random_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    """Prompts of prompt_len/2..prompt_len tokens, responses of response_len/2..response_len."""
    from ppo_trainer.batch import Batch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt_len + response_len), generator=gen)
    attn = torch.zeros_like(ids)
    for i in range(rows):
        p = int(torch.randint(prompt_len // 2, prompt_len + 1, (), generator=gen))
        r = int(torch.randint(max(1, response_len // 2), response_len + 1, (), generator=gen))
        attn[i, prompt_len - p : prompt_len + r] = 1
    ids = ids * attn
    mask = attn[:, prompt_len:].clone()
    return Batch(
        input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0), response_mask=mask,
        advantages=torch.randn(rows, response_len, generator=gen) * mask,
        returns=torch.randn(rows, response_len, generator=gen) * mask,
    )


def timed(fn):
    fn()  # warm-up
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="a causal-LM folder (default: a random Llama built in a temp dir)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=16, help="sequences per update")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--mini-batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument("--budget", type=int, default=1024, help="algorithm.ppo_micro_batch_tokens")
    parser.add_argument("--chunk", type=int, default=1024, help="model.logprob_chunk_tokens")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging

    logging.set_verbosity_error()  # the critic loads a causal-LM folder: its lm_head is expected unused
    logging.disable_progress_bar()

    from ppo_trainer.config.schema import AlgorithmConfig, CriticConfig, LoraConfig, ModelConfig, OptimConfig
    from ppo_trainer.engine.actor import ActorEngine
    from ppo_trainer.engine.critic import CriticEngine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else build_model(Path(tmp), args.hidden, args.layers,
                                                                            args.vocab, args.seed)
        vocab = args.vocab
        if args.model_dir:
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        batch = random_batch(args.rows, args.prompt_len, args.response_len, vocab, args.seed)
        algorithm = AlgorithmConfig(ppo_epochs=args.ppo_epochs, ppo_micro_batch_tokens=args.budget)
        model_cfg = ModelConfig(
            path=str(model_dir), dtype=args.dtype, logprob_chunk_tokens=args.chunk,
            gradient_checkpointing=args.gradient_checkpointing,
            lora=LoraConfig(rank=args.lora_rank), optim=OptimConfig(lr=1e-6),
        )
        actor = ActorEngine(model_cfg, model_dir, algorithm, mini_batch_size=args.mini_batch, device=args.device)
        critic = CriticEngine(
            CriticConfig(dtype=args.dtype, gradient_checkpointing=args.gradient_checkpointing), model_dir, algorithm,
            mini_batch_size=args.mini_batch, device=args.device,
        )
        batch = batch.with_fields(old_logprobs=actor.compute_logprobs(batch), values=critic.compute_values(batch))
        tokens = int(batch.num_tokens().sum())
        rows = [
            ("actor logprobs (no grad)", tokens, timed(lambda: actor.compute_logprobs(batch))),
            ("actor update", tokens * args.ppo_epochs, timed(lambda: actor.update(batch))),
            ("critic values (no grad)", tokens, timed(lambda: critic.compute_values(batch))),
            ("critic update", tokens * args.ppo_epochs, timed(lambda: critic.update(batch))),
        ]

    params = sum(p.numel() for p in actor.policy.parameters())
    print(f"model: {'random Llama' if not args.model_dir else model_dir}, {params / 1e6:.1f}M params, "
          f"vocab {vocab}; dtype {args.dtype}; device {args.device}; threads {torch.get_num_threads()}; "
          f"{args.rows} rows x (<= {args.prompt_len} + {args.response_len}) tokens; budget {args.budget}")
    print(f"{'measurement':<26}{'tokens':>9}{'seconds':>10}{'tokens/s':>11}")
    for name, n, seconds in rows:
        print(f"{name:<26}{n:>9}{seconds:>10.3f}{n / seconds:>11.0f}")


if __name__ == "__main__":
    main()
