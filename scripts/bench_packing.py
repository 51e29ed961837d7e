"""Packing across prompts (`algorithm.pack_sequences`) against padded rows, through the real engines.

    python scripts/bench_packing.py                    # both workloads, every layout
    python scripts/bench_packing.py --workload uneven --json packing.json

Workloads (synthetic batches of random token ids on the embedded SmolLM2-135M-Instruct; `--rows`
sequences of `--n` samples per prompt):
- `recipe`: the gsm8k_cpu recipe's update: 16 prompts x 4 samples, prompts of 45-60 tokens,
  responses of 16-64 (its max_new_tokens), eager attention, LoRA rank 32 actor, full critic,
  ppo_micro_batch_tokens 1152, mini-batches of 8 prompts.
- `uneven`: long, uneven reasoning-like responses: 4 prompts x 4 samples (and, with `--n 1`, 16
  prompts of one sample), prompts of 80-120 tokens, responses of 32-512, sdpa, full actor and
  critic, ppo_micro_batch_tokens 4096, one mini-batch.

Layouts (`models.packing`): `padded` (the default: each micro-batch padded to its longest row, a
prompt's samples sharing its tokens where the attention takes a 4D mask), `packed` (several blocks
to a row, the same 4D mask), `by-positions` (single sequences packed, told apart by their positions:
transformers builds the block mask itself, what flash attention's variable-length path does on GPU).

Each timing is one call after an untimed warm-up; the actor's and critic's forward (no grad) and
update. Quote the machine's matmul rate (printed) beside the times.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

WORKLOADS = {
    "recipe": dict(prompts=16, n=4, prompt_len=(45, 60), response_len=(16, 64), attn="eager", lora_rank=32,
                   budget=1152, mini_batch_prompts=8),
    "uneven": dict(prompts=4, n=4, prompt_len=(80, 120), response_len=(32, 512), attn="sdpa", lora_rank=0,
                   budget=4096, mini_batch_prompts=4),
}
LAYOUTS = ("padded", "packed", "by-positions")


def synthetic_batch(prompts: int, n: int, prompt_len: tuple[int, int], response_len: tuple[int, int], vocab: int,
                    seed: int):
    """`prompts` x `n` rows: each prompt's samples share its random tokens; lengths uniform in the ranges."""
    from ppo_trainer.batch import Batch

    gen = torch.Generator().manual_seed(seed)

    def uniform(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=gen))

    P, T = prompt_len[1], response_len[1]
    ids = torch.zeros(prompts * n, P + T, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for g in range(prompts):
        p = uniform(*prompt_len)
        prompt = torch.randint(3, vocab, (p,), generator=gen)
        for row in range(g * n, (g + 1) * n):
            r = uniform(*response_len)
            ids[row, P - p : P] = prompt
            ids[row, P : P + r] = torch.randint(3, vocab, (r,), generator=gen)
            attn[row, P - p : P + r] = 1
    mask = attn[:, P:].clone()
    return Batch(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0),
                 response_mask=mask, advantages=torch.randn(len(ids), T, generator=gen) * mask,
                 returns=torch.randn(len(ids), T, generator=gen) * mask)


def timed(fn) -> tuple[float, object]:
    fn()  # warm-up
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def matmul_gflops(dtype: torch.dtype, size: int = 1024, repeats: int = 20) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def measure(workload: dict, layout: str, model_dir: Path, seed: int) -> dict:
    """Seconds of the actor's and critic's forward and update on the workload's batch in `layout`,
    and the update's `padding_share`."""
    import ppo_trainer.models.packing as packing
    from ppo_trainer.config.schema import AlgorithmConfig, CriticConfig, LoraConfig, ModelConfig, OptimConfig
    from ppo_trainer.engine.actor import ActorEngine
    from ppo_trainer.engine.critic import CriticEngine

    masked = packing.MASKED_ATTENTION
    if layout == "by-positions":  # no 4D masks: the layout flash attention gets
        packing.MASKED_ATTENTION = ()
    try:
        w = workload
        algorithm = AlgorithmConfig(ppo_micro_batch_tokens=w["budget"], pack_sequences=layout != "padded")
        mini_batch = w["mini_batch_prompts"] * w["n"]
        actor = ActorEngine(ModelConfig(path=str(model_dir), dtype="auto", attn_implementation=w["attn"],
                                        logprob_chunk_tokens=256, lora=LoraConfig(rank=w["lora_rank"], alpha=64),
                                        optim=OptimConfig(lr=1e-6)),
                            model_dir, algorithm, mini_batch_size=mini_batch)
        critic = CriticEngine(CriticConfig(dtype="auto", optim=OptimConfig(lr=1e-6)), model_dir, algorithm,
                              mini_batch_size=mini_batch, attn_implementation=w["attn"])
        batch = synthetic_batch(w["prompts"], w["n"], w["prompt_len"], w["response_len"],
                                actor.policy.hf_model.config.vocab_size, seed)
        batch = batch.with_fields(old_logprobs=actor.compute_logprobs(batch), values=critic.compute_values(batch))
        result = {"layout": layout, "dtype": str(actor.dtype), "real_tokens": int(batch.attention_mask.sum())}
        result["actor_forward_s"], _ = timed(lambda: actor.compute_logprobs(batch))
        result["actor_update_s"], stats = timed(lambda: actor.update(batch))
        result["actor_padding_share"] = stats["actor/padding_share"]
        result["critic_forward_s"], _ = timed(lambda: critic.compute_values(batch))
        result["critic_update_s"], stats = timed(lambda: critic.update(batch))
        result["critic_padding_share"] = stats["critic/padding_share"]
        return result
    finally:
        packing.MASKED_ATTENTION = masked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append",
                        help="repeatable; default: all")
    parser.add_argument("--n", type=int, help="samples per prompt, overriding the workload's (same total rows)")
    parser.add_argument("--layout", choices=LAYOUTS, action="append", help="repeatable; default: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    from transformers.utils import logging

    logging.set_verbosity_error()  # the critic loads a causal-LM folder: its lm_head is expected unused
    logging.disable_progress_bar()
    from ppo_trainer.dtypes import compute_dtype, resolve_dtype
    from ppo_trainer.models.loading import resolve_model_path

    model_dir = resolve_model_path("embedded:smollm2-135m-instruct")
    dtype = compute_dtype(resolve_dtype("auto", "cpu"))
    rate = matmul_gflops(dtype)
    print(f"CPU matmul ({dtype}, 1024^3): {rate:.0f} GFLOP/s; threads {torch.get_num_threads()}")
    results = []
    for name in args.workload or sorted(WORKLOADS):
        workload = dict(WORKLOADS[name])
        if args.n:
            workload.update(prompts=workload["prompts"] * workload["n"] // args.n, n=args.n,
                            mini_batch_prompts=workload["mini_batch_prompts"] * workload["n"] // args.n)
        print(f"\n{name}: {workload}")
        print(f"{'layout':<14}{'actor fwd s':>12}{'actor upd s':>12}{'critic fwd s':>13}{'critic upd s':>13}"
              f"{'total s':>9}{'padding':>9}")
        for layout in args.layout or LAYOUTS:
            r = measure(workload, layout, model_dir, args.seed)
            total = r["actor_forward_s"] + r["actor_update_s"] + r["critic_forward_s"] + r["critic_update_s"]
            print(f"{layout:<14}{r['actor_forward_s']:>12.2f}{r['actor_update_s']:>12.2f}{r['critic_forward_s']:>13.2f}"
                  f"{r['critic_update_s']:>13.2f}{total:>9.2f}{r['actor_padding_share']:>9.1%}", flush=True)
            results.append({"workload": name, **workload, **r, "total_s": total, "matmul_gflops": rate})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
