"""Rollout throughput: HF generate vs the vLLM engine on the same prompts (tokens per second).

    python scripts/bench_rollout.py                       # tiny + SmolLM2-135M, both engines
    python scripts/bench_rollout.py --models tiny --prompts 64 --n 4 --max-new-tokens 32

Prompts are the built-in arithmetic validation problems in the model's chat template. Each
(model, engine) pair runs in a fresh subprocess (engine threads and vLLM's process-wide state
stay isolated) and reports: engine start seconds, generated tokens (response_mask sum), generate
seconds of the timed call after one small warm-up, tokens/s. Sampling is seeded, at temperature 1,
so responses have similar (not equal) lengths across engines; the tokens/s compares fairly, the
seconds do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MODELS = {"tiny": "random:tiny", "smollm2": "embedded:smollm2-135m-instruct"}


def run_one(model: str, engine: str, args: argparse.Namespace) -> dict:
    """Build one sampler, warm it up, time one generate call."""
    import torch

    from ppo_trainer.config.schema import DataConfig, SamplerConfig, VllmConfig
    from ppo_trainer.data import load_prompts
    from ppo_trainer.models.loading import load_tokenizer, resolve_model_path
    from ppo_trainer.rollout import HFSampler, VllmSampler, prompts_to_batch

    model_dir = resolve_model_path(MODELS[model])
    tokenizer = load_tokenizer(model_dir)
    records = load_prompts(DataConfig(source="arithmetic"), tokenizer, "val")[: args.prompts]
    prompts = prompts_to_batch([r.prompt_ids for r in records], tokenizer.pad_token_id)
    cfg = SamplerConfig(
        name=engine, max_new_tokens=args.max_new_tokens, generate_batch_size=args.hf_batch_size,
        vllm=VllmConfig(enforce_eager=True, kv_cache_gb=1.0),
    )
    start = time.perf_counter()
    if engine == "hf":
        sampler = HFSampler(model_dir, cfg, batch_size=args.hf_batch_size, dtype=args.dtype)
    else:
        max_len = prompts.input_ids.shape[1] + args.max_new_tokens
        sampler = VllmSampler(model_dir, cfg, dtype=args.dtype, max_model_len=max_len)
    start_s = time.perf_counter() - start
    sampler.generate(prompts.select([0]), 1, seed=123)  # warm-up
    start = time.perf_counter()
    out = sampler.generate(prompts, args.n, seed=0)
    seconds = time.perf_counter() - start
    tokens = int(out.response_mask.sum())
    return {
        "model": model, "engine": engine, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "sequences": len(out), "start_s": round(start_s, 1), "tokens": tokens, "gen_s": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1), "mean_len": round(tokens / len(out), 1),
        "truncated": round(out.truncated.float().mean().item(), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2", help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                        help="float32 by default: CPUs without AMX or AVX512-BF16 run bf16 matmuls slower")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="sequences per HF generate call")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print("RESULT " + json.dumps(run_one(*args.worker, args)), flush=True)
        return

    scratch = tempfile.mkdtemp(prefix="bench-rollout-")
    env = {**os.environ, "TMPDIR": scratch, "VLLM_CACHE_ROOT": os.path.join(scratch, "vllm"),
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error", "VLLM_LOGGING_LEVEL": "WARNING"}
    results = []
    for model in args.models.split(","):
        for engine in args.engines.split(","):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", model, engine]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"{model}/{engine} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            results.append(json.loads(lines[-1][len("RESULT "):]))
            print(json.dumps(results[-1]), flush=True)

    print(f"\n{args.prompts} prompts x n={args.n}, max_new_tokens={args.max_new_tokens}, {args.dtype}, "
          f"{os.cpu_count()} CPUs")
    header = f"{'model':8} {'engine':6} {'start_s':>8} {'tokens':>7} {'gen_s':>7} {'tokens/s':>9} {'mean_len':>9}"
    print(header)
    for r in results:
        print(f"{r['model']:8} {r['engine']:6} {r['start_s']:8.1f} {r['tokens']:7d} {r['gen_s']:7.2f} "
              f"{r['tokens_per_s']:9.1f} {r['mean_len']:9.1f}")
    for model in args.models.split(","):
        rate = {r["engine"]: r["tokens_per_s"] for r in results if r["model"] == model}
        if "hf" in rate and "vllm" in rate:
            print(f"{model}: vLLM / HF = {rate['vllm'] / rate['hf']:.1f}x")


if __name__ == "__main__":
    main()
