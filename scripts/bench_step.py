"""One PPO step of a fixed workload through the real Trainer roles: per-phase seconds, tokens/s,
peak memory, and each phase against its matmul floor on this machine.

Presets:
- `qwen0.5b` (the GPU workload): a random-initialised Qwen2.5-0.5B-shaped model (hidden
  896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings), 256
  prompts of 128 tokens, exactly 256 response tokens each, one epoch in 4 mini-batches, HF sampler.
- `smollm2` (the CPU recipe's model): the embedded SmolLM2-135M-Instruct, 16 prompts "What is {a} +
  {b}?" (a, b up to 999) through the gsm8k_cpu recipe's prompt format, 32 new tokens each, vLLM
  rollout, one epoch in one mini-batch.
- `tiny` (`--tiny`): a small random shape on CPU in about a minute.
Every preset: full-parameter actor and critic, the reference forward (KL on), responses of exactly
the preset's length (`sampler.ignore_eos`), compute dtype `auto` unless --dtype says otherwise.

    python scripts/bench_step.py --preset smollm2
    python scripts/bench_step.py --tiny
    python scripts/bench_step.py --preset qwen0.5b --device cuda --json bench_step.json

Floors (matmul FLOPs at the measured matmul rate of the compute dtype): a forward costs 2 x body x
tokens + 2 x head x response tokens, where body counts the parameters every token multiplies
(all but the input embedding) and head = vocab x hidden (the critic has no head); a training pass
costs 3 forwards. gen = max(that forward, decode steps x weight bytes / copy bandwidth).

--plain adds a tighter reference than the matmul floor: the plain transformers model (parameters in
the compute dtype, no FSDP, no fp32 master copy, no optimizer) on a batch of the step's shape, in
the engines' micro-batches, timed as the phases use it: a no-grad forward (old_logprob, ref; values
with the value model) and a forward and backward (update_actor, update_critic). A phase near its plain
time spends what the model's own forward and backward cost; what an update adds on top is the
mixed-precision casts, gradient clipping and AdamW.

The engines' start-up and per-call output goes to --engine-log, as `ppo-train` sends it to
engine.log; --verbose keeps it on the terminal.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

PRESETS = {
    "qwen0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936, prompts=256, prompt_len=128, response_len=256,
                     mini_batches=4, micro_tokens=24576, sampler="hf"),
    "smollm2": dict(prompts=16, response_len=32, mini_batches=1, max_operand=999, sampler="vllm"),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=2048, prompts=16, prompt_len=32, response_len=32,
                 mini_batches=4, micro_tokens=2048, sampler="hf"),
}
PHASES = ["gen", "old_logprob", "ref", "values", "adv", "update_critic", "update_actor", "sync", "step"]


@dataclass
class Ceilings:
    tflops: float  # matmul in the compute dtype, TFLOP/s
    bandwidth: float  # device copy, bytes/s


def measure_ceilings(device: str, dtype: torch.dtype) -> Ceilings:
    """Matmul throughput in the compute dtype and copy bandwidth, best of a few repeats."""
    n = 8192 if device == "cuda" else 2048
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
    y = torch.empty_like(x)  # preallocated: a fresh buffer per copy would time its page faults
    copy = best(lambda: y.copy_(x), 5)
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


def addition_prompts(folder: Path, shape: dict, seed: int) -> Path:
    """A jsonl of `shape["prompts"]` questions "What is {a} + {b}?" with a, b up to max_operand."""
    rng = random.Random(seed)
    prompts = folder / "prompts.jsonl"
    with prompts.open("w") as f:
        for _ in range(shape["prompts"]):
            a, b = rng.randint(1, shape["max_operand"]), rng.randint(1, shape["max_operand"])
            f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"}) + "\n")
    return prompts


def bench_config(model_dir: Optional[Path], prompts: Path, shape: dict, device: str, dtype: str, output_dir: Path):
    """The preset's config (`bench_overrides`)."""
    from ppo_trainer.config.composition import compose

    return compose(bench_overrides(model_dir, prompts, shape, device, dtype, output_dir))


def bench_overrides(model_dir: Optional[Path], prompts: Path, shape: dict, device: str, dtype: str,
                    output_dir: Path) -> list[str]:
    """The preset's ppo-train overrides; `model_dir` None: the gsm8k_cpu recipe with the embedded model."""
    if model_dir is None:
        model = ["+experiment=gsm8k_cpu"]
    else:
        model = [f"model.path={model_dir}", "data.use_chat_template=false", "data.prompt_template='{question}'",
                 "data.instruction=''", f"data.max_prompt_length={shape['prompt_len']}",
                 f"algorithm.ppo_micro_batch_tokens={shape['micro_tokens']}", f"sampler.generate_batch_size={shape['prompts']}"]
    return [
        *model, f"model.dtype={dtype}", f"critic.dtype={dtype}", "model.lora.rank=0",
        f"sampler={shape['sampler']}", "sampler.n=1", f"sampler.max_new_tokens={shape['response_len']}",
        "sampler.ignore_eos=true", "data.source=files", f"data.train_files=[{prompts}]", f"data.val_files=[{prompts}]",
        f"data.train_batch_size={shape['prompts']}",
        f"algorithm.ppo_mini_batch_size={shape['prompts'] // shape['mini_batches']}", "algorithm.ppo_epochs=1",
        "gae.kl_coef=0.001", f"devices={'gpu' if device == 'cuda' else 'cpu'}",
        f"trainer.output_dir={output_dir}", "trainer.loggers=[jsonl]", "trainer.total_steps=100",
    ]


def matmul_params(model: torch.nn.Module) -> tuple[int, int]:
    """(body, head): the parameters every token multiplies (all but the input embedding and the
    output projection), and those of the output projection (vocab x hidden; 0 without one)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = head.weight if head is not None else None
    body = sum(p.numel() for p in model.parameters() if p is not embedding and p is not head_weight)
    return body, (head_weight.numel() if head_weight is not None else 0)


def floors(actor: tuple[int, int], critic: tuple[int, int], tokens: int, response_tokens: int, steps: int,
           weight_bytes: int, c: Ceilings) -> dict[str, float]:
    """Seconds per phase at the matmul rate (gen: or the weight reads of its decode steps)."""
    peak = c.tflops * 1e12

    def forward(params: tuple[int, int]) -> float:
        return (2 * params[0] * tokens + 2 * params[1] * response_tokens) / peak

    out = {"gen": max(forward(actor), steps * weight_bytes / c.bandwidth), "old_logprob": forward(actor),
           "ref": forward(actor), "values": forward(critic),
           "update_critic": 3 * forward(critic), "update_actor": 3 * forward(actor)}
    out["step"] = sum(out.values())
    return out


def rollout_shaped_batch(records, pad_id: int, response_len: int, vocab_size: int, seed: int):
    """The step's batch shape from the loader's prompt `records`: each prompt left-padded, then
    `response_len` random response tokens (the bench samples with `ignore_eos`: every response is full)."""
    from ppo_trainer.rollout.base import assemble_rollout, prompts_to_batch

    prompts = prompts_to_batch([r.prompt_ids for r in records], pad_id)
    generator = torch.Generator().manual_seed(seed)
    responses = torch.randint(vocab_size, (len(records), response_len), generator=generator).tolist()
    return assemble_rollout(prompts, 1, responses, [[0.0] * response_len] * len(records), [True] * len(records),
                            [""] * len(records), pad_id)


def plain_seconds(cfg, batch, device: str, dtype: torch.dtype, repeats: int = 3) -> dict[str, float]:
    """Median seconds (after one warm-up) of the plain transformers policy and value model on
    `batch`, per phase as the engines run it: a no-grad forward (old_logprob and values; ref is the
    same forward of the same model as old_logprob), a forward and backward (the updates)."""
    import statistics

    from ppo_trainer.engine.microbatch import plan_micro_batches
    from ppo_trainer.models.actor import CausalLMPolicy, load_causal_lm
    from ppo_trainer.models.critic import ValueModel
    from ppo_trainer.models.loading import resolve_model_path

    model_dir = resolve_model_path(cfg.model.path)
    attn = cfg.model.attn_implementation
    policy = CausalLMPolicy(load_causal_lm(str(model_dir), attn_implementation=attn, dtype=dtype),
                            cfg.model.logprob_chunk_tokens, cfg.algorithm.pack_sequences).to(device).train()
    critic_dir = resolve_model_path(cfg.critic.path, part="critic") if cfg.critic.path else model_dir
    critic = ValueModel.from_pretrained(critic_dir, attn_implementation=attn).to(device=device, dtype=dtype).train()
    critic.pack_sequences = cfg.algorithm.pack_sequences
    with_entropy = cfg.algorithm.entropy_coef > 0

    # the engines' own micro-batches (token budget, laid out as the engines do: `models.packing`)
    micro_batches = [m.batch.to(device) for m in plan_micro_batches(
        batch, cfg.algorithm.ppo_micro_batch_tokens, policy.layout)]

    def policy_loss(micro) -> torch.Tensor:
        logp, entropy = policy(micro.input_ids, micro.attention_mask, micro.position_ids, micro.response_mask,
                               cfg.sampler.temperature, with_entropy)
        loss = -(logp * micro.response_mask).sum()
        return loss - (entropy * micro.response_mask).sum() if with_entropy else loss

    def value_loss(micro) -> torch.Tensor:
        values = critic(micro.input_ids, micro.attention_mask, micro.position_ids, micro.response_mask)
        return ((values - 1.0).square() * micro.response_mask).sum()

    def timed(loss_fn, module: torch.nn.Module) -> tuple[float, float]:
        """(no-grad forward, forward and backward) seconds."""
        forwards, updates = [], []
        for _ in range(repeats + 1):
            _sync(device)
            start = time.perf_counter()
            with torch.no_grad():
                for micro in micro_batches:
                    loss_fn(micro)
            _sync(device)
            middle = time.perf_counter()
            for micro in micro_batches:
                loss_fn(micro).backward()
            _sync(device)
            forwards.append(middle - start)
            updates.append(time.perf_counter() - middle)
            module.zero_grad(set_to_none=True)
        return statistics.median(forwards[1:]), statistics.median(updates[1:])

    old_logprob, update_actor = timed(policy_loss, policy)
    values, update_critic = timed(value_loss, critic)
    return {"old_logprob": old_logprob, "ref": old_logprob, "values": values, "update_actor": update_actor,
            "update_critic": update_critic}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen0.5b")
    parser.add_argument("--tiny", action="store_true", help="shortcut for --preset tiny --device cpu")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="compute dtype (auto: bf16 where the device computes it natively, else fp32)")
    parser.add_argument("--steps", type=int, default=3, help="PPO steps; the first is a warm-up")
    parser.add_argument("--peak-tflops", type=float, help="matmul peak in the compute dtype (default: measured)")
    parser.add_argument("--bandwidth", type=float, help="device bandwidth in bytes/s (default: measured)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain", action="store_true",
                        help="also time the plain transformers models on the step's batch shape (see above)")
    parser.add_argument("--engine-log", type=Path, default=Path(tempfile.gettempdir()) / "ppo-bench-step-engine.log",
                        help="where the engines' output goes (rewritten each run; default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="the engines' output on the terminal")
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.device = "tiny", "cpu"
    shape = PRESETS[args.preset]

    from ppo_trainer.config.derived import uses_reference
    from ppo_trainer.console import console_stream, engine_output_to_file
    from ppo_trainer.dtypes import resolve_dtype

    dtype = resolve_dtype(args.dtype, args.device)
    measured = measure_ceilings(args.device, getattr(torch, dtype))
    ceilings = Ceilings(args.peak_tflops or measured.tflops, args.bandwidth or measured.bandwidth)
    args.engine_log.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp, engine_output_to_file(args.engine_log, args.verbose):
        from ppo_trainer.trainer import Trainer  # after the engines' log levels are set

        if args.preset == "smollm2":
            model_dir, prompts = None, addition_prompts(Path(tmp), shape, args.seed)
        else:
            model_dir, prompts = build_workload(Path(tmp), shape, args.seed)
        cfg = bench_config(model_dir, prompts, shape, args.device, dtype, Path(tmp) / "out")
        trainer = Trainer.from_config(cfg)
        try:
            actor = trainer.actor.workers.worker.engine.policy.hf_model
            critic = trainer.critic.workers.worker.engine.model.backbone
            # every step trains on all the prompts (one epoch of the data): its real tokens
            step_tokens = sum(len(r.prompt_ids) for r in trainer.loader.records) + shape["prompts"] * shape["response_len"]
            runs = []
            for step in range(1, args.steps + 1):
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                metrics, _ = trainer.train_step(step)
                runs.append(metrics)
                print(f"step {step}: {metrics['timing_s/step']:.2f} s", file=console_stream(), flush=True)
            actor_params, critic_params = matmul_params(actor), matmul_params(critic)
            weight_bytes = sum(p.numel() for p in actor.parameters()) * torch.finfo(getattr(torch, dtype)).bits // 8
            records, pad_id, vocab_size = trainer.loader.records, trainer.pad_id, actor.config.vocab_size
        finally:
            trainer.close()
        del trainer, actor, critic
        batch = rollout_shaped_batch(records, pad_id, shape["response_len"], vocab_size, args.seed)
        plain = plain_seconds(cfg, batch, args.device, getattr(torch, dtype)) if args.plain else {}

    measured_runs = runs[1:] or runs
    seconds = {p: sum(r.get(f"timing_s/{p}", 0.0) for r in measured_runs) / len(measured_runs) for p in PHASES}
    response_tokens = shape["prompts"] * shape["response_len"]
    floor = floors(actor_params, critic_params, step_tokens, response_tokens, shape["response_len"], weight_bytes,
                   ceilings)
    # a phase the config skips (the recipe's recompute_old_logprobs=false) has no floor in the step's;
    # its timer still runs (for microseconds), so the config says which
    skipped = {"old_logprob"} if not cfg.algorithm.recompute_old_logprobs else set()
    skipped |= set() if uses_reference(cfg) else {"ref"}
    floor = {p: f for p, f in floor.items() if p not in skipped}
    floor["step"] = sum(f for p, f in floor.items() if p != "step")
    result = {
        "preset": args.preset, "device": args.device, "dtype": dtype,
        "params": {"actor_body": actor_params[0], "actor_head": actor_params[1], "critic_body": critic_params[0]},
        "tokens_per_step": step_tokens, "response_tokens_per_step": response_tokens,
        "ceilings": {"matmul_tflops": ceilings.tflops, "bandwidth_gb_s": ceilings.bandwidth / 1e9},
        "seconds": seconds, "floor_seconds": floor,
        "tokens_per_s": {"step": step_tokens / seconds["step"], "gen": response_tokens / seconds["gen"]},
        "peak_memory_gb": measured_runs[-1]["perf/max_memory_allocated_gb"],
        "plain_seconds": plain,
    }
    if args.engine_log.is_file():
        print(f"engine output: {args.engine_log}")
    print(f"preset {args.preset} on {args.device} ({dtype}): actor {sum(actor_params) / 1e6:.1f}M matmul params, "
          f"{step_tokens} tokens/step ({response_tokens} generated); ceilings {ceilings.tflops * 1e3:.0f} GFLOP/s, "
          f"{ceilings.bandwidth / 1e9:.0f} GB/s")
    print(f"{'phase':15s} {'seconds':>9s} {'floor':>9s} {'x floor':>8s}" + (f" {'plain':>9s} {'x plain':>8s}" if plain else ""))
    for phase in PHASES:
        f, base = floor.get(phase), (None if phase in skipped else plain.get(phase))
        ratio = f"{seconds[phase] / f:8.2f}" if f else f"{'':8s}"
        line = f"{phase:15s} {seconds[phase]:9.3f} {f if f else float('nan'):9.3f} {ratio}"
        if plain:
            line += f" {base:9.3f} {seconds[phase] / base:8.2f}" if base else f" {'':9s} {'':8s}"
        print(line)
    print(f"tokens/s: step {result['tokens_per_s']['step']:.0f}, generation {result['tokens_per_s']['gen']:.0f}; "
          f"peak memory {result['peak_memory_gb']:.2f} GB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
