"""`ppo-eval`, and `evaluate_records`: the one evaluation function, which the trainer's validation
calls too. A response is correct when it scores at least `reward.correct_score`."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from ppo_trainer.batch import Batch
from ppo_trainer.checkpoint import STEP_DIR, latest_checkpoint, read_pointer
from ppo_trainer.config import ConfigError, compose, validate_static
from ppo_trainer.data import PromptRecord, load_prompts
from ppo_trainer.models.loading import ModelPathError, load_tokenizer, resolve_model_path
from ppo_trainer.rewards.loader import RewardFn, load_reward_fn, score_all
from ppo_trainer.rewards.math import EXTRACTORS, extract_strict
from ppo_trainer.rollout import build_sampler, vllm as vllm_rollout
from ppo_trainer.rollout.base import prompts_to_batch
from ppo_trainer.tracking import engine_output_to_file
from ppo_trainer.workers.devices import bound_cpu_kernel_caches

logger = logging.getLogger("ppo_trainer")


def prompt_batch(records: Sequence[PromptRecord], pad_id: int) -> Batch:
    return prompts_to_batch([r.prompt_ids for r in records], pad_id, prompt_text=[r.question for r in records],
                            ground_truth=[r.ground_truth for r in records], prompt_index=[r.index for r in records])


def evaluate_records(generate: Callable[[Batch], Batch], records: Sequence[PromptRecord], reward_fn: RewardFn, *,
                     pad_id: int, limit: Optional[int] = None, batch_size: int = 64, correct_score: float = 1.0,
                     on_error: str = "raise", extract: Callable[[str], Optional[str]] = extract_strict,
                     output_file: Optional[str | Path] = None) -> dict[str, Any]:
    """Greedy responses (`generate`: one per prompt) to the first `limit` records, scored with
    `reward_fn`; the rows go to `output_file` as jsonl if given. Returns accuracy, num_correct,
    mean_score, truncated_fraction, num_examples, output_file."""
    records = list(records)[:limit]
    rows: list[dict[str, Any]] = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        out = generate(prompt_batch(chunk, pad_id))
        scores, _ = score_all(reward_fn, out.response_text, out.ground_truth, on_error)
        for record, response, score, truncated in zip(chunk, out.response_text, scores, out.truncated.tolist()):
            rows.append({"index": record.index, "question": record.question, "response": response,
                         "extracted": extract(response), "ground_truth": record.ground_truth, "score": score,
                         "correct": score >= correct_score, "truncated": truncated})
        logger.info("eval: %d/%d prompts, accuracy so far %.3f", len(rows), len(records),
                    sum(r["correct"] for r in rows) / len(rows))
    if output_file is not None:
        Path(output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(output_file).write_text("".join(json.dumps(row) + "\n" for row in rows))
    n, correct = len(rows), sum(r["correct"] for r in rows)
    return {"accuracy": correct / n, "num_correct": correct, "mean_score": sum(r["score"] for r in rows) / n,
            "truncated_fraction": sum(r["truncated"] for r in rows) / n, "num_examples": n,
            "output_file": None if output_file is None else str(output_file)}


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% for the default z): unlike the normal
    approximation it stays inside [0, 1] and does not collapse at 0 or n successes."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs 0 <= successes <= n and n >= 1, got {successes} of {n}")
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def resolve_target(path: str, scratch: Path) -> tuple[Path, Optional[Path], Optional[int]]:
    """(model folder, the run's config file or None, checkpoint step or None) of a ppo-eval model.path:
    a model, a checkpoint's actor folder, a `global_step_N` folder (its merged LoRA export, else its
    actor), a pointer file or a run folder (its latest checkpoint). The config is the one the
    checkpoint was trained with (state/config.yaml), else the run's config.yaml. An adapter is merged
    under `scratch`."""
    local = Path(path).expanduser()
    actor: Optional[Path] = None
    if local.is_file() and local.parent.name == "checkpoints":  # checkpoints/latest or checkpoints/best
        step_folder = read_pointer(local)
    elif local.is_dir() and (local / "checkpoints").is_dir() and not (local / "config.json").is_file():
        step_folder = latest_checkpoint(local)
        if step_folder is None:
            raise ModelPathError(f"model.path='{path}': the run holds no checkpoint yet")
    elif local.is_dir() and STEP_DIR.match(local.name):
        step_folder = local
    elif local.is_dir() and STEP_DIR.match(local.parent.name):
        step_folder, actor = local.parent, local
    elif (local / "adapter_config.json").is_file():
        return _merge_adapter(local, None, scratch), None, None
    else:
        return resolve_model_path(path), None, None

    run_config = next((c for c in (step_folder / "state" / "config.yaml", step_folder.parent.parent / "config.yaml")
                       if c.is_file()), None)
    step = int(STEP_DIR.match(step_folder.name).group(1))
    if actor is None:
        merged = step_folder / "actor_merged"
        actor = merged if (merged / "config.json").is_file() else step_folder / "actor"
    if (actor / "adapter_config.json").is_file():
        return _merge_adapter(actor, run_config, scratch), run_config, step
    if not (actor / "config.json").is_file():
        raise ModelPathError(f"model.path='{path}': {actor} holds neither a model (config.json) nor a LoRA adapter")
    return actor, run_config, step


def _merge_adapter(adapter: Path, run_config: Optional[Path], scratch: Path) -> Path:
    """The LoRA adapter merged into its base model (the run's model.path), saved as a model folder under `scratch`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = (OmegaConf.load(run_config).model.path if run_config is not None
            else json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path"))
    base_dir = resolve_model_path(base)
    logger.info("eval: applying the LoRA adapter %s to its base %s", adapter, base_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                      str(adapter)).merge_and_unload()
    out = Path(tempfile.mkdtemp(prefix="merged-", dir=scratch))
    model.save_pretrained(out)
    tokenizer_dir = adapter if (adapter / "tokenizer_config.json").is_file() else base_dir
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def model_paths(overrides: list[str]) -> tuple[list[str], list[str]]:
    """The `model.path` values of the overrides (one, or a list `[A,B]`) and the other overrides."""
    paths: list[str] = []
    for override in (o for o in overrides if o.partition("=")[0] == "model.path"):
        value = OverridesParser.create().parse_overrides([override])[0].value()
        paths = [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return paths, [o for o in overrides if o.partition("=")[0] != "model.path"]


def eval_config(composed: Any, overrides: list[str], run_config: Optional[Path]) -> Any:
    """The run's config (`resolve_target`) with each key or group that `overrides` name taken from `composed`."""
    if run_config is None:
        return composed
    cfg = OmegaConf.load(run_config)
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key == "experiment":
            raise ConfigError(f"+experiment does not apply to a checkpoint: {run_config} gives the run's "
                              "settings; override single keys instead")
        OmegaConf.update(cfg, key, OmegaConf.select(composed, key), merge=False)
    return validate_static(cfg)


def run_eval(overrides: list[str]) -> list[dict[str, Any]]:
    """`ppo-eval`: every `model.path` of `overrides` on the same problems. A run's checkpoint uses
    the run's config.yaml under the overrides and its sampler; any other model vLLM if installed,
    else HF. Each result is `evaluate_records`' plus `model`, `step` and `seconds`."""
    paths, rest = model_paths(overrides)
    composed = compose(rest)
    paths = paths or [composed.model.path]  # the model of an experiment, or the default
    with tempfile.TemporaryDirectory(prefix="ppo-eval-") as scratch:
        targets = [resolve_target(p, Path(scratch)) for p in paths]
        run_config = next((config for _, config, _ in targets if config is not None), None)
        cfg = eval_config(composed, rest, run_config)
        if run_config is not None:
            logger.info("eval: data, prompts, reward and sampler of the run (%s)", run_config)
        name = cfg.sampler.name if run_config is not None else "hf" if vllm_rollout.check_vllm_available() else "vllm"
        sampler_cfg = dataclasses.replace(OmegaConf.to_object(cfg.sampler), name=name, n=1,
                                          max_new_tokens=cfg.eval.max_new_tokens)
        default_file = Path(cfg.eval.output_file or Path(cfg.trainer.output_dir) / "eval.jsonl")
        reward_fn = load_reward_fn(cfg.reward)
        results = []
        bound_cpu_kernel_caches()  # as a trainer's workers do: greedy batches shrink step by step (new shapes)
        # the engines' start-up chatter and per-call warnings go next to the responses, as in ppo-train
        with engine_output_to_file(default_file.parent / "engine.log", cfg.trainer.verbose):
            for i, (path, (model_dir, _, step)) in enumerate(zip(paths, targets)):
                numbered = default_file.with_suffix(f".{i}{default_file.suffix}")
                output_file = default_file if len(targets) == 1 else numbered
                tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
                records = load_prompts(cfg.data, tokenizer, "val")[: cfg.eval.limit]
                logger.info("eval: greedy decoding with %s", "vLLM" if name == "vllm" else "Hugging Face generate")
                sampler = build_sampler(sampler_cfg, model_dir, dtype=cfg.model.dtype,
                                        max_prompt_length=max(len(r.prompt_ids) for r in records),
                                        trust_remote_code=cfg.model.trust_remote_code)
                start = time.perf_counter()
                try:
                    result = evaluate_records(lambda batch: sampler.generate(batch, 1, seed=0, greedy=True), records,
                                              reward_fn, pad_id=tokenizer.pad_token_id, batch_size=cfg.eval.batch_size,
                                              correct_score=cfg.reward.correct_score, on_error=cfg.reward.on_error,
                                              extract=EXTRACTORS[cfg.reward.mode], output_file=output_file)
                finally:
                    del sampler
                    gc.collect()  # the next model's engine gets the memory
                results.append({"model": path, "step": step, **result, "seconds": time.perf_counter() - start})
    print(format_results(results, cfg.reward.mode))
    return results


def format_results(results: list[dict[str, Any]], reward_mode: str) -> str:
    """One line for one model; a table (one row per model) for several."""
    def interval(r: dict[str, Any]) -> str:
        return "{:.3f}-{:.3f}".format(*wilson_interval(r["num_correct"], r["num_examples"]))

    def model(r: dict[str, Any]) -> str:
        return r["model"] if r["step"] is None else f"{r['model']} (step {r['step']})"

    if len(results) == 1:
        r = results[0]
        return (f"ppo-eval: accuracy {r['accuracy']:.4f} (95% CI {interval(r)}) on {r['num_examples']} problems "
                f"({model(r)}, reward.mode={reward_mode}); responses in {r['output_file']}")
    header = ("model", "accuracy", "95% CI", "problems", "mean score", "responses")
    rows = [(model(r), f"{r['accuracy']:.4f}", interval(r), str(r["num_examples"]), f"{r['mean_score']:.4f}",
             r["output_file"]) for r in results]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return f"ppo-eval: {len(results)} models on the same problems (reward.mode={reward_mode})\n" + "\n".join(lines)
