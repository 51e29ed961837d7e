"""`ppo-eval`: greedy accuracy of a model on prompt records, with every response written to jsonl.

Greedy decoding runs through vLLM when it is installed (much faster), else through the Hugging
Face sampler. A response is correct when the reward function gives it at least
`reward.correct_score` (the trainer's `val/accuracy` uses the same rule).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ppo_trainer.config import EvalConfig, SamplerConfig
from ppo_trainer.data.datasets import PromptRecord
from ppo_trainer.rewards.loader import RewardFn, score_all
from ppo_trainer.rewards.math import extract_flexible, extract_strict
from ppo_trainer.rollout.base import Sampler, prompts_to_batch

logger = logging.getLogger("ppo_trainer")

Extractor = Callable[[str], Optional[str]]


def evaluate_records(
    sampler: Sampler,
    records: Sequence[PromptRecord],
    reward_fn: RewardFn,
    *,
    pad_id: int,
    batch_size: int = 64,
    correct_score: float = 1.0,
    extract: Extractor = extract_strict,
    output_file: Optional[str | Path] = None,
) -> dict[str, Any]:
    """Greedy responses of `sampler` to `records`, scored; one jsonl row per record if `output_file`.

    Rows: index, question, response, extracted (the answer `extract` reads, or null),
    ground_truth, score, correct, truncated. Returns accuracy (fraction with score >=
    correct_score), mean_score, truncated_fraction, num_examples, output_file.
    """
    if not records:
        raise ValueError("evaluate: no records to evaluate")
    rows: list[dict[str, Any]] = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        prompts = prompts_to_batch([r.prompt_ids for r in chunk], pad_id, prompt_text=[r.question for r in chunk],
                                   ground_truth=[r.ground_truth for r in chunk], prompt_index=[r.index for r in chunk])
        out = sampler.generate(prompts, 1, seed=0, greedy=True)
        scores, _ = score_all(reward_fn, out.response_text, out.ground_truth)
        for record, response, score, truncated in zip(chunk, out.response_text, scores, out.truncated.tolist()):
            rows.append({
                "index": record.index,
                "question": record.question,
                "response": response,
                "extracted": extract(response),
                "ground_truth": record.ground_truth,
                "score": score,
                "correct": score >= correct_score,
                "truncated": truncated,
            })
        logger.info("eval: %d/%d prompts, accuracy so far %.3f", len(rows), len(records),
                    sum(r["correct"] for r in rows) / len(rows))

    if output_file is not None:
        path = Path(output_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return {
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        "mean_score": sum(r["score"] for r in rows) / len(rows),
        "truncated_fraction": sum(r["truncated"] for r in rows) / len(rows),
        "num_examples": len(rows),
        "output_file": None if output_file is None else str(output_file),
    }


def build_eval_sampler(
    model_dir: str | Path,
    sampler_cfg: SamplerConfig,
    eval_cfg: EvalConfig,
    *,
    max_prompt_length: int,
    dtype: str = "bfloat16",
    engine: str = "auto",
    trust_remote_code: bool = False,
) -> Sampler:
    """A sampler for greedy evaluation: vLLM ("auto": when installed) or HF, with eval.max_new_tokens."""
    from ppo_trainer.rollout.hf import HFSampler
    from ppo_trainer.rollout.vllm import VllmSampler, check_vllm_available

    if engine not in ("auto", "hf", "vllm"):
        raise ValueError(f"engine is {engine!r}; allowed values: auto, hf, vllm")
    cfg = dataclasses.replace(sampler_cfg, n=1, max_new_tokens=eval_cfg.max_new_tokens)
    problem = check_vllm_available()
    if engine == "vllm" and problem:
        raise ImportError(problem)
    if engine == "vllm" or (engine == "auto" and problem is None):
        logger.info("eval: greedy decoding with vLLM")
        return VllmSampler(model_dir, cfg, dtype=dtype, max_model_len=max_prompt_length + cfg.max_new_tokens,
                           trust_remote_code=trust_remote_code)
    logger.info("eval: greedy decoding with Hugging Face generate (vLLM is not installed)")
    return HFSampler.from_pretrained(model_dir, cfg, batch_size=eval_cfg.batch_size, dtype=dtype,
                                     trust_remote_code=trust_remote_code)


def evaluate(
    model_dir: str | Path,
    records: Sequence[PromptRecord],
    sampler_cfg: SamplerConfig,
    eval_cfg: EvalConfig,
    reward_fn: RewardFn,
    *,
    dtype: str = "bfloat16",
    correct_score: float = 1.0,
    extract: Extractor = extract_strict,
    engine: str = "auto",
    output_file: Optional[str | Path] = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Greedy accuracy of the model in `model_dir` on the first `eval.limit` records (all if None).

    The sampler uses `sampler_cfg`'s stop strings and engine settings with eval.max_new_tokens;
    prompts go in batches of eval.batch_size. See `evaluate_records` for the result and jsonl rows.
    """
    from ppo_trainer.models.loading import load_tokenizer

    records = list(records)[: eval_cfg.limit] if eval_cfg.limit is not None else list(records)
    if not records:
        raise ValueError("evaluate: no records to evaluate")
    pad_id = load_tokenizer(model_dir).pad_token_id
    sampler = build_eval_sampler(model_dir, sampler_cfg, eval_cfg, dtype=dtype, engine=engine,
                                 max_prompt_length=max(len(r.prompt_ids) for r in records),
                                 trust_remote_code=trust_remote_code)
    start = time.perf_counter()
    result = evaluate_records(sampler, records, reward_fn, pad_id=pad_id, batch_size=eval_cfg.batch_size,
                              correct_score=correct_score, extract=extract, output_file=output_file)
    result["seconds"] = time.perf_counter() - start
    return result


def run_eval(cfg: Any) -> dict[str, Any]:
    """`ppo-eval` on a validated (typed) config: model.path on the data group's validation split.

    Writes eval.output_file (default `<trainer.output_dir>/eval.jsonl`) and prints one summary line.
    """
    from omegaconf import OmegaConf

    from ppo_trainer.data import load_prompts
    from ppo_trainer.models.loading import load_tokenizer, resolve_model_path
    from ppo_trainer.rewards.loader import load_reward_fn

    model_dir = resolve_model_path(cfg.model.path)
    records = load_prompts(cfg.data, load_tokenizer(model_dir), "val")
    eval_cfg: EvalConfig = OmegaConf.to_object(cfg.eval)
    output_file = eval_cfg.output_file or str(Path(cfg.trainer.output_dir) / "eval.jsonl")
    result = evaluate(
        model_dir, records, OmegaConf.to_object(cfg.sampler), eval_cfg, load_reward_fn(cfg.reward),
        dtype=cfg.model.dtype, correct_score=cfg.reward.correct_score,
        extract=extract_flexible if cfg.reward.mode == "flexible" else extract_strict,
        output_file=output_file, trust_remote_code=cfg.model.trust_remote_code,
    )
    print(f"ppo-eval: accuracy {result['accuracy']:.4f} on {result['num_examples']} prompts "
          f"({cfg.model.path}, reward.mode={cfg.reward.mode}); responses in {output_file}")
    return result
