"""One PPO step of a fixed workload through the real Trainer roles: per-phase seconds, tokens/s,
MFU, peak memory, and the hardware floor of each phase.

Workload (`--preset qwen0.5b`, the performance issue's): a random-initialised Qwen2.5-0.5B-shaped
model (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied
embeddings), bf16 compute, 256 prompts of 128 tokens, exactly 256 response tokens each
(`sampler.ignore_eos`), full-parameter actor and critic, one PPO epoch in 4 mini-batches, KL on
(reference forward included). `--tiny` runs a small shape on CPU in about a minute.

    python scripts/bench_step.py --tiny
    python scripts/bench_step.py --preset qwen0.5b --device cuda --json bench_step.json

Floors: training costs 6 x params x tokens FLOPs per model (actor and critic), a no-grad forward
2 x params x tokens (old logprobs, reference, values), and decoding is bound by
max(2 x params x tokens / peak, steps x weight bytes / bandwidth). MFU = 6 x params x tokens /
seconds / peak. Peak FLOP/s and bandwidth are measured on the device unless given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PRESETS = {
    "qwen0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936, prompts=256, prompt_len=128, response_len=256,
                     mini_batches=4, micro_tokens=24576),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=2048, prompts=16, prompt_len=32, response_len=32,
                 mini_batches=4, micro_tokens=2048),
}


@dataclass
class Ceilings:
    tflops: float  # matmul in the compute dtype, TFLOP/s
    bandwidth: float  # device copy, bytes/s


def measure_ceilings(device: str, dtype: torch.dtype) -> Ceilings:
    """Matmul throughput in the compute dtype and copy bandwidth, best of a few repeats."""
    n = 8192 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    x = torch.empty(256 * 2**20 if device == "cuda" else 32 * 2**20, dtype=torch.uint8, device=device)

    def best(fn, reps: int) -> float:
        times = []
        for _ in range(reps):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - start)
        return min(times)

    a @ b
    mm = best(lambda: [a @ b for _ in range(10)], 3) / 10
    copy = best(lambda: x.clone(), 5)
    return Ceilings(tflops=2 * n**3 / mm / 1e12, bandwidth=2 * x.numel() / copy)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_workload(folder: Path, shape: dict, seed: int) -> tuple[Path, Path]:
    """A random Qwen2 model folder with a word-level tokenizer over its whole vocabulary, and a
    jsonl of prompts that tokenize to exactly `prompt_len` tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"], tie_word_embeddings=True,
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=0,
    )
    model_dir = folder / "model"
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2").save_pretrained(model_dir)
    rng = random.Random(seed)
    prompts = folder / "prompts.jsonl"
    with prompts.open("w") as f:
        for _ in range(shape["prompts"]):
            words = " ".join(f"t{rng.randrange(3, shape['vocab_size'])}" for _ in range(shape["prompt_len"]))
            f.write(json.dumps({"question": words, "answer": "#### 1"}) + "\n")
    return model_dir, prompts


def bench_config(model_dir: Path, prompts: Path, shape: dict, device: str, dtype: str, output_dir: Path):
    from ppo_trainer.config import compose

    return compose([
        f"model.path={model_dir}", f"model.dtype={dtype}", f"critic.dtype={dtype}", "model.lora.rank=0",
        "sampler=hf", "sampler.n=1", f"sampler.max_new_tokens={shape['response_len']}", "sampler.ignore_eos=true",
        f"sampler.generate_batch_size={shape['prompts']}",
        "data.source=files", f"data.train_files=[{prompts}]", f"data.val_files=[{prompts}]",
        "data.use_chat_template=false", "data.prompt_template='{question}'", "data.instruction=''",
        f"data.train_batch_size={shape['prompts']}", f"data.max_prompt_length={shape['prompt_len']}",
        f"algorithm.ppo_mini_batch_size={shape['prompts'] // shape['mini_batches']}",
        f"algorithm.ppo_micro_batch_tokens={shape['micro_tokens']}", "algorithm.ppo_epochs=1",
        "gae.kl_coef=0.001", f"devices={'gpu' if device == 'cuda' else 'cpu'}",
        f"trainer.output_dir={output_dir}", "trainer.loggers=[jsonl]", "trainer.total_steps=100",
    ])


def floors(params: int, shape: dict, c: Ceilings) -> dict[str, float]:
    tokens = shape["prompts"] * (shape["prompt_len"] + shape["response_len"])
    peak = c.tflops * 1e12
    decode_compute = 2 * params * shape["prompts"] * shape["response_len"] / peak
    decode_memory = shape["response_len"] * 2 * params / c.bandwidth
    return {
        "gen": max(decode_compute, decode_memory),
        "forwards": 3 * 2 * params * tokens / peak,
        "updates": 2 * 6 * params * tokens / peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen0.5b")
    parser.add_argument("--tiny", action="store_true", help="shortcut for --preset tiny --device cpu")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help="compute dtype (default: bfloat16 on cuda, float32 on cpu, where bf16 lacks fast kernels)")
    parser.add_argument("--steps", type=int, default=3, help="PPO steps; the first is a warm-up")
    parser.add_argument("--peak-tflops", type=float, help="bf16 peak (default: measured)")
    parser.add_argument("--bandwidth", type=float, help="device bandwidth in bytes/s (default: measured)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.device = "tiny", "cpu"
    shape = PRESETS[args.preset]
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    from ppo_trainer.trainer import Trainer

    measured = measure_ceilings(args.device, getattr(torch, dtype))
    ceilings = Ceilings(args.peak_tflops or measured.tflops, args.bandwidth or measured.bandwidth)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts = build_workload(Path(tmp), shape, args.seed)
        cfg = bench_config(model_dir, prompts, shape, args.device, dtype, Path(tmp) / "out")
        trainer = Trainer.from_config(cfg)
        try:
            params = sum(p.numel() for p in trainer.actor.workers.role.engine.policy.parameters())
            runs = []
            for step in range(1, args.steps + 1):
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                metrics, _ = trainer.train_step(step)
                runs.append(metrics)
                print(f"step {step}: {metrics['timing_s/step']:.2f} s", file=sys.stderr)
        finally:
            trainer.close()

    measured_runs = runs[1:] or runs
    phases = ["gen", "old_logprob", "ref", "values", "adv", "update_critic", "update_actor", "sync", "step"]
    seconds = {p: sum(r[f"timing_s/{p}"] for r in measured_runs) / len(measured_runs) for p in phases}
    tokens = shape["prompts"] * (shape["prompt_len"] + shape["response_len"])
    floor = floors(params, shape, ceilings)
    peak = ceilings.tflops * 1e12
    mfu = {
        "update_actor": 6 * params * tokens / seconds["update_actor"] / peak,
        "update_critic": 6 * params * tokens / seconds["update_critic"] / peak,
        "forwards": 3 * 2 * params * tokens / (seconds["old_logprob"] + seconds["ref"] + seconds["values"]) / peak,
    }
    result = {
        "preset": args.preset, "device": args.device, "dtype": dtype, "params": params, "tokens_per_step": tokens,
        "ceilings": {"matmul_tflops": ceilings.tflops, "bandwidth_gb_s": ceilings.bandwidth / 1e9},
        "seconds": seconds, "floor_seconds": {**floor, "step": sum(floor.values())},
        "tokens_per_s": {"step": tokens / seconds["step"],
                         "gen": shape["prompts"] * shape["response_len"] / seconds["gen"]},
        "mfu": mfu, "peak_memory_gb": measured_runs[-1]["perf/max_memory_allocated_gb"],
    }
    print(f"preset {args.preset} on {args.device} ({dtype}): {params / 1e6:.1f}M params, {tokens} tokens/step, "
          f"ceilings {ceilings.tflops:.3f} TFLOP/s, {ceilings.bandwidth / 1e9:.0f} GB/s")
    print(f"{'phase':15s} {'seconds':>9s}")
    for phase in phases:
        print(f"{phase:15s} {seconds[phase]:9.3f}")
    print(f"floor: gen {floor['gen']:.3f} s, forwards {floor['forwards']:.3f} s, updates {floor['updates']:.3f} s, "
          f"step {sum(floor.values()):.3f} s")
    print(f"tokens/s: step {result['tokens_per_s']['step']:.0f}, generation {result['tokens_per_s']['gen']:.0f}; "
          f"MFU actor {mfu['update_actor']:.1%}, critic {mfu['update_critic']:.1%}, forwards {mfu['forwards']:.1%}; "
          f"peak memory {result['peak_memory_gb']:.2f} GB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
