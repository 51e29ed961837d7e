"""What has to hold on a GPU before a real run, checked in one call (scripts/gpu_check.sh runs it).

    OUT=/tmp/check bash scripts/gpu_check.sh               # one CUDA GPU: Qwen2.5-0.5B shapes, the gsm8k recipe
    OUT=/tmp/check bash scripts/gpu_check.sh --rehearse    # the same steps on the CPU with the tiny model

Each step writes its result into $OUT/gpu_check.json as soon as it ends, so a run cut short by a
time limit still returns what ran. The steps: the device and its bf16 matmul rate; a random-init
model of Qwen2.5-0.5B's shapes (vocabulary included) with the tiny character tokenizer, as the
actor's and the critic's start; the memory plan of the gsm8k recipe for it; one PPO step of that
recipe on one device with the HF sampler (full-length responses), each phase's seconds and each
role's peak memory against the plan; a checkpoint saved, resumed into fresh engines and compared
weight by weight (DCP round trip); the actor's export reloaded by transformers, its logits against
the engine's; packed (shared-prompt) attention against the rows run alone; no NaN anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from pathlib import Path
from typing import Any, Callable

GIB = 2**30
QWEN_0_5B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 32768,
             "tie_word_embeddings": True}


class Report:
    """$OUT/gpu_check.json, rewritten after every step."""

    def __init__(self, out: Path, mode: str):
        self.path = out / "gpu_check.json"
        self.data: dict[str, Any] = {"mode": mode, "steps": {}, "ok": None}
        out.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        start = time.perf_counter()
        print(f"gpu_check: {name} ...", flush=True)
        try:
            result = {"ok": True, **fn()}
        except Exception as e:  # noqa: BLE001  (every failure is a result to report, then the next step)
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - start, 2)
        self.data["steps"][name] = result
        self.data["ok"] = all(s["ok"] for s in self.data["steps"].values())
        self.write()
        print(f"gpu_check: {name}: {'ok' if result['ok'] else 'FAILED ' + result['error']} ({result['seconds']} s)",
              flush=True)
        return result


def device_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=list(torch.cuda.get_device_capability()),
                    memory_gib=round(props.total_memory / GIB, 1))
    n = 4096 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    start = time.perf_counter()
    for _ in range(10):
        b = a @ a
    b.sum().item()
    info["bf16_matmul_tflops"] = round(10 * 2 * n**3 / (time.perf_counter() - start) / 1e12, 3)
    return info


def build_model(folder: Path, rehearse: bool) -> dict[str, Any]:
    """A random Qwen2.5-0.5B-shaped causal LM with the tiny tokenizer (its ids are a few of the vocabulary's)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ppo_trainer.models.tiny import TINY_ARCHITECTURE, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    shape = {**TINY_ARCHITECTURE, "vocab_size": len(tokenizer)} if rehearse else QWEN_0_5B
    ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**shape, **ids))
    model.generation_config.update(**ids)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"folder": str(folder), "parameters": sum(p.numel() for p in model.parameters())}


def overrides(model: Path, out: Path, rehearse: bool) -> list[str]:
    """The gsm8k recipe on the arithmetic generator (no hub), one device, HF sampler, full-length responses."""
    common = [f"model.path={model}", "sampler=hf", "sampler.ignore_eos=true", "data=arithmetic",
              "data.arithmetic.val_size=16", "eval.limit=16", f"trainer.output_dir={out / 'run'}",
              "trainer.loggers=[jsonl]", "trainer.save_every=1"]
    if rehearse:
        return ["+experiment=gsm8k", *common, "devices=cpu", "model.dtype=float32", "critic.dtype=float32",
                "data.train_batch_size=4", "algorithm.ppo_mini_batch_size=2", "sampler.max_new_tokens=16",
                "data.max_prompt_length=256", "algorithm.ppo_micro_batch_tokens=1024", "eval.max_new_tokens=16",
                "sampler.generate_batch_size=8"]
    return ["+experiment=gsm8k", *common, "sampler.generate_batch_size=256"]


def one_step(cfg: Any, plan_total: float) -> dict[str, Any]:
    """A PPO step of the recipe; its phases, each role's peak memory, the plan's total."""
    from ppo_trainer.run import trainer_state
    from ppo_trainer.run.folder import absolute_output_dir, exclusive
    from ppo_trainer.trainer import Trainer

    with exclusive(absolute_output_dir(cfg)):
        trainer = Trainer.from_config(cfg)
        try:
            trainer.step = 1
            metrics, _ = trainer.train_step(1)
            trainer_state.save(trainer)
        finally:
            trainer.close()
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise ValueError(f"non-finite metrics: {bad}")
    peaks = {k.split("/")[1]: round(v, 2) for k, v in metrics.items() if k.endswith("/max_memory_allocated_gb")
             and k.count("/") == 2}
    measured = metrics["perf/max_memory_allocated_gb"]
    return {"phases_s": {k.removeprefix("timing_s/"): round(v, 2) for k, v in metrics.items() if k.startswith("timing_s/")},
            "peak_gib_by_role": peaks, "peak_gib": round(measured, 2), "plan_gib": round(plan_total / GIB, 2),
            "plan_error": round((plan_total / GIB - measured) / measured, 3),
            "response_length": metrics["response_length/mean"], "score": metrics["critic/score/mean"]}


def resume_round_trip(cfg: Any) -> dict[str, Any]:
    """Fresh engines resumed from the step's checkpoint hold the weights the step ended with."""
    import torch
    from safetensors.torch import load_file

    from ppo_trainer.engine.actor import ActorEngine
    from ppo_trainer.engine.critic import CriticEngine
    from ppo_trainer.run.folder import absolute_output_dir, exclusive
    from ppo_trainer.trainer import Trainer

    folder = absolute_output_dir(cfg) / "checkpoints" / "global_step_1"
    exported = load_file(folder / "critic" / "model.safetensors")
    with exclusive(absolute_output_dir(cfg)):
        trainer = Trainer.from_config(cfg)
        try:
            actor_state = trainer.actor.run_all(ActorEngine.full_state_dict)[0]
            critic = trainer.critic.run_all(CriticEngine.full_state_dict)[0]
            dtype = getattr(torch, trainer.critic.workers.worker.engine.dtype)
        finally:
            trainer.close()
    assert trainer.step == 1, trainer.step
    gaps = {}
    for name, value in critic.items():  # the critic's export (compute dtype) against the resumed master weights
        key = name.replace("backbone.", "model.", 1).replace("value_head.", "score.", 1)
        gaps[name] = (value.float() - exported[key].float()).abs().max().item()
    dtype_eps = torch.finfo(dtype).eps
    worst = max(gaps.values())
    if worst > 4 * dtype_eps * max(v.abs().max().item() for v in critic.values()):
        raise ValueError(f"resumed critic differs from its export by {worst}")
    return {"actor_tensors": len(actor_state), "critic_worst_gap": worst}


def export_reload(cfg: Any, device: str) -> dict[str, Any]:
    """transformers loads the actor's export; its logits on a prompt match a forward of the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(cfg.trainer.output_dir) / "checkpoints" / "global_step_1" / "actor"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    ids = torch.arange(3, 40, device=device)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not torch.isfinite(logits).all():
        raise ValueError("non-finite logits from the exported model")
    return {"logits_abs_max": round(logits.abs().max().item(), 3)}


def packed_attention(model_dir: Path, device: str) -> dict[str, Any]:
    """Packed rows (a prompt's samples in one block, a 4D mask; with packing several blocks per row; the
    sequences told apart by their positions alone) against each row alone, sdpa and eager."""
    import torch
    from transformers import AutoModel

    from ppo_trainer.models.packing import Layout, states_before_response_tokens

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 90, (12,), generator=gen).tolist()
    rows = [(prompt, torch.randint(3, 90, (n,), generator=gen).tolist()) for n in (5, 9, 2)]
    rows.append((prompt[:5], rows[0][1]))  # a second prompt: a block of its own
    P, T = len(prompt), max(len(r) for _, r in rows)
    ids = torch.zeros(len(rows), P + T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        ids[i, P - len(p) : P + len(r)] = torch.tensor(p + r)
        mask[i, P - len(p) : P + len(r)] = 1
    inputs = (ids.to(device), mask.to(device), ((mask.cumsum(1) - 1).clamp(min=0)).to(device), mask[:, P:].to(device))
    layouts = {"shared": Layout(share_prompts=True), "packed": Layout(share_prompts=True, pack=True),
               "by positions": Layout(pack=True)}
    gaps = {}
    for implementation in ("sdpa", "eager"):
        decoder = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=implementation)
        decoder = decoder.to(device).eval()
        with torch.no_grad():
            alone = torch.cat([decoder(input_ids=torch.tensor([p + r], device=device)).last_hidden_state[0][len(p) - 1 : -1]
                               for p, r in rows])
            for name, layout in layouts.items():
                packed = states_before_response_tokens(decoder, *inputs, layout)
                gap = (packed - alone).abs().max().item() / alone.abs().max().item()
                if not gap < 1e-4:  # float32 (TF32 off by default for matmuls in torch 2.x): summation order only
                    raise ValueError(f"{implementation}, {name}: packed states differ from rows alone by {gap:.2e} "
                                     "(relative)")
                gaps[f"{implementation}, {name}"] = gap
    return {"relative_gap": gaps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true", help="the same steps on the CPU with tiny shapes")
    args = parser.parse_args()
    import torch

    from ppo_trainer.config.composition import compose
    from ppo_trainer.config.derived import uses_reference
    from ppo_trainer.plan.memory import memory_plan

    device = "cpu" if args.rehearse else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; --rehearse runs the steps on the CPU")
    report = Report(args.out, "rehearse" if args.rehearse else "gpu")
    report.step("device", lambda: device_info(device))
    model_dir = args.out / "model"
    report.step("model", lambda: build_model(model_dir, args.rehearse))
    cfg = compose(overrides(model_dir, args.out, args.rehearse))
    plan: dict[str, Any] = {}

    def make_plan() -> dict[str, Any]:
        lines = memory_plan(cfg, uses_reference(cfg))
        total = next(line for line in lines if line.startswith("  total"))
        plan["total"] = float(total.split()[1]) * GIB
        return {"lines": lines}

    report.step("memory plan", make_plan)
    report.step("one PPO step", lambda: one_step(cfg, plan.get("total", float("nan"))))
    report.step("DCP resume round trip", lambda: resume_round_trip(compose(overrides(model_dir, args.out, args.rehearse))))
    report.step("export reload", lambda: export_reload(cfg, device))
    report.step("packed attention", lambda: packed_attention(model_dir, device))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "traceback"} for k, v in report.data["steps"].items()},
                     indent=1, default=str))
    print(f"gpu_check: {'all steps ok' if report.data['ok'] else 'FAILED'}; summary in {report.path}")
    raise SystemExit(0 if report.data["ok"] else 1)


if __name__ == "__main__":
    main()
