"""`ppo-eval`, and `evaluate_records`: the one evaluation function, which the trainer's validation
calls too. A response is correct when the reward function's "acc" says so, or, without one, when it
scores at least `reward.correct_score` (`rewards.scoring.Accuracy`); with eval.n samples per prompt
the accuracy is mean@n (correct responses over responses) and pass@n the share of prompts with at
least one correct response, pooled and per data_source."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import tempfile
import time
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from ppo_trainer.batch import Batch
from ppo_trainer.run.checkpoint import STEP_DIR, latest_checkpoint, read_pointer
from ppo_trainer.config.composition import compose, load_saved
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.config.validation import validate_static
from ppo_trainer.data import PromptRecord, load_prompts
from ppo_trainer.models.loading import ModelPathError, load_tokenizer, resolve_model_path
from ppo_trainer.rewards.calling import RewardInput, is_builtin
from ppo_trainer.rewards.math import EXTRACTORS, extract_strict
from ppo_trainer.rewards.scoring import Scorer, build_scorer
from ppo_trainer.rollout import build_sampler, vllm as vllm_rollout
from ppo_trainer.rollout.base import prompts_to_batch
from ppo_trainer.tracking import engine_output_to_file
from ppo_trainer.workers.process_tuning import bound_cpu_kernel_caches

logger = logging.getLogger("ppo_trainer")


def prompt_batch(records: Sequence[PromptRecord], pad_id: int) -> Batch:
    return prompts_to_batch([r.prompt_ids for r in records], pad_id, prompt_text=[r.question for r in records],
                            prompt_messages=[r.messages for r in records], ground_truth=[r.ground_truth for r in records],
                            data_source=[r.data_source for r in records], extra_info=[r.extra_info for r in records])


def reward_inputs(records: Sequence[PromptRecord], n: int, responses: Sequence[str]) -> list[RewardInput]:
    """What the reward is told about each of `responses` [len(records) * n], row i*n+j being sample
    j of records[i]."""
    if len(responses) != len(records) * n:
        raise ValueError(f"{len(responses)} responses for {len(records)} prompts x n={n}")
    return [RewardInput(response, record.ground_truth, record.data_source, record.extra_info, record.prompt,
                        record.messages, record.where) for response, record in zip(responses, (r for r in records for _ in range(n)))]


def first_per_source(records: Sequence[PromptRecord], limit: Optional[int]) -> list[PromptRecord]:
    """The first `limit` records of each data_source (all of them when None), in their order."""
    taken: Counter[str] = Counter()
    kept = []
    for record in records:
        if limit is None or taken[record.data_source] < limit:
            taken[record.data_source] += 1
            kept.append(record)
    return kept


def eval_temperature(temperature: Optional[float], n: int, sampler_temperature: float) -> Optional[float]:
    """The temperature validation samples at, None for greedy: eval.temperature (0: greedy); when
    it is null, greedy for eval.n=1 and sampler.temperature for more samples."""
    if temperature is None:
        return None if n == 1 else sampler_temperature
    return None if temperature == 0 else temperature


def validation_seed(seed: int, step: int) -> int:
    """The sampling seed of the validation after `step`: fixed by (trainer.seed, step), so a
    resumed run and ppo-eval of that step's checkpoint draw the same samples; not the seed of the
    step's training samples (`trainer.step_seed`)."""
    return (seed * 1_000_003 + step * 7_919 + 104_729) % (2**31 - 1)


def evaluate_records(generate: Callable[[Batch, int], Batch], records: Sequence[PromptRecord], scorer: Scorer, *,
                     pad_id: int, n: int = 1, seed: int = 0, limit: Optional[int] = None, batch_size: int = 64,
                     extract: Callable[[str], Optional[str]] = extract_strict,
                     output_file: Optional[str | Path] = None) -> dict[str, Any]:
    """`n` responses to each of the first `limit` records of each data_source, `batch_size` prompts
    per `generate(prompts, seed)` call (n rows per prompt, sample j of prompt i at row i*n+j; call k
    gets `seed + k`), scored by `scorer` (correct: `scorer.accuracy`). One row per response, with the
    reward's named extras, goes to `output_file` as jsonl if given. Returns `summarize` of every
    response, "sources": `summarize` of each data_source's (in order of appearance), "n" and
    "output_file"."""
    records = first_per_source(records, limit)
    rows: list[dict[str, Any]] = []
    for call, start in enumerate(range(0, len(records), batch_size)):
        chunk = records[start : start + batch_size]
        out = generate(prompt_batch(chunk, pad_id), (seed + call) % (2**31 - 1))
        if len(out) != len(chunk) * n:
            raise ValueError(f"evaluate_records: {len(out)} responses for {len(chunk)} prompts x n={n}")
        scores = scorer.score(reward_inputs(chunk, n, out.response_text))
        for row, (response, score, extras, truncated) in enumerate(zip(out.response_text, scores.values, scores.extras,
                                                                       out.truncated.tolist())):
            record = chunk[row // n]
            rows.append({"data_source": record.data_source, "index": record.index, "sample": row % n,
                         "question": record.question, "prompt": record.prompt, "response": response,
                         "extracted": extract(response), "ground_truth": record.ground_truth,
                         "extra_info": record.extra_info, "score": score, "extras": extras,
                         "correct": scorer.accuracy.correct(score, extras), "truncated": truncated})
        logger.info("eval: %d/%d prompts, accuracy so far %.3f", start + len(chunk), len(records),
                    sum(r["correct"] for r in rows) / len(rows))
    if output_file is not None:
        Path(output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(output_file).write_text("".join(json.dumps(row) + "\n" for row in rows))
    by_source: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_source.setdefault(row["data_source"], []).append(row)
    return {**summarize(rows, n), "sources": {name: summarize(part, n) for name, part in by_source.items()}, "n": n,
            "output_file": None if output_file is None else str(output_file)}


def summarize(rows: Sequence[dict[str, Any]], n: int) -> dict[str, Any]:
    """Figures of evaluation rows whose prompts' `n` responses are adjacent: accuracy (correct over
    responses: mean@n), num_correct, mean_score, truncated_fraction, num_examples (prompts),
    num_responses, pass_at_n (prompts with a correct response over prompts; a fractional "acc"
    counts its best response's value)."""
    count, prompts = len(rows), len(rows) // n
    correct = sum(r["correct"] for r in rows)
    passed = sum(max(r["correct"] for r in rows[i : i + n]) for i in range(0, count, n))
    return {"accuracy": correct / count, "num_correct": correct, "mean_score": sum(r["score"] for r in rows) / count,
            "truncated_fraction": sum(r["truncated"] for r in rows) / count, "num_examples": prompts,
            "num_responses": count, "pass_at_n": passed / prompts}


def validation_metrics(result: dict[str, Any]) -> dict[str, float]:
    """An `evaluate_records` result as metrics: val/accuracy and val/score/mean over every response,
    val/<data_source>/accuracy and val/<data_source>/score/mean (the name verbatim, slashes kept),
    and for n > 1 .../accuracy/mean@n and .../accuracy/pass@n, pooled and per data_source."""
    n = result["n"]
    metrics: dict[str, float] = {}
    for prefix, summary in [("val", result), *((f"val/{name}", part) for name, part in result["sources"].items())]:
        metrics[f"{prefix}/accuracy"] = summary["accuracy"]
        metrics[f"{prefix}/score/mean"] = summary["mean_score"]
        if n > 1:
            metrics[f"{prefix}/accuracy/mean@{n}"] = summary["accuracy"]
            metrics[f"{prefix}/accuracy/pass@{n}"] = summary["pass_at_n"]
    return metrics


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

    base = (load_saved(run_config).model.path if run_config is not None
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


# Keys a run folder's stored config never sets for ppo-eval (a folder from elsewhere must not run
# code or choose where files go): they come from the command line or the defaults.
NOT_FROM_RUN_FOLDER = ("model.trust_remote_code", "reward.model.trust_remote_code", "trainer.output_dir",
                       "eval.output_file")


def eval_config(composed: Any, overrides: list[str], run_config: Optional[Path]) -> Any:
    """The run's config (`resolve_target`) with each key or group that `overrides` name taken from
    `composed`, and `NOT_FROM_RUN_FOLDER` always. A `reward.fn` outside ppo_trainer runs only when the
    command line names it: else ConfigError."""
    if run_config is None:
        return composed
    cfg = load_saved(run_config)
    named = [override.key_or_group for override in OverridesParser.create().parse_overrides(overrides)]
    if "experiment" in named:
        raise ConfigError(f"+experiment does not apply to a checkpoint: {run_config} gives the run's "
                          "settings; override single keys instead")
    remote_code = ("model.trust_remote_code" not in named and OmegaConf.select(cfg, "model.trust_remote_code") is True)
    also = (" (and its model.trust_remote_code=true is not taken either: pass model.trust_remote_code=true too if "
            "you trust the folder)") if remote_code else ""
    for key in ("reward.fn", "eval.reward_fn"):  # the functions ppo-eval may call
        stored_fn = OmegaConf.select(cfg, key)
        if stored_fn is None or any(name in (key, key.partition(".")[0]) for name in named) or is_builtin(stored_fn):
            continue
        raise ConfigError(f"the run's config ({run_config}) names {key}={stored_fn}, code that ppo-eval does not "
                          f"run from a run folder unless told to: pass {key}={stored_fn} on the command line to "
                          f"trust it, or another {key}{also}")
    if remote_code:
        logger.warning("eval: the run's config sets model.trust_remote_code=true; ppo-eval does not take it from a "
                       "run folder (pass model.trust_remote_code=true to run the model folder's code)")
    for key in [*named, *NOT_FROM_RUN_FOLDER]:
        OmegaConf.update(cfg, key, OmegaConf.select(composed, key), merge=False)
    return validate_static(cfg)


def validation_scorer(cfg: Any) -> Scorer:
    """ppo-eval's scorer: eval.reward_fn, else reward.fn (a run trained on a reward model or server
    alone is evaluated by the function its command line names)."""
    key = "eval.reward_fn" if cfg.eval.reward_fn else "reward.fn"
    scorer = build_scorer(OmegaConf.merge(cfg.reward, {"fn": OmegaConf.select(cfg, key)}), key)
    if scorer is None:
        raise ConfigError("ppo-eval scores with a reward function, and neither eval.reward_fn nor reward.fn names one "
                          "(the run was trained on a reward model or server): pass eval.reward_fn=module:function")
    return scorer


def run_eval(overrides: list[str]) -> list[dict[str, Any]]:
    """`ppo-eval`: every `model.path` of `overrides` on the same problems, responses written to
    `eval.output_file` (default eval.jsonl in the current folder). A run's checkpoint uses the
    run's config under the overrides (`eval_config`) and its sampler; any other model vLLM if installed,
    else HF. eval.n samples per prompt seeded as the run's validation of the checkpoint's step.
    Each result is `evaluate_records`' plus `model`, `step`, `temperature` (None: greedy) and `seconds`."""
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
        default_file = Path(cfg.eval.output_file or "eval.jsonl")  # the current folder, also for a run's checkpoint
        n = cfg.eval.n
        temperature = eval_temperature(cfg.eval.temperature, n, cfg.sampler.temperature)
        sampling = {"greedy": True} if temperature is None else {"temperature": temperature}
        decoding = "greedy decoding" if temperature is None else f"{n} samples per prompt at temperature {temperature}"
        results = []
        bound_cpu_kernel_caches()  # as a trainer's workers do: greedy batches shrink step by step (new shapes)
        # the engines' start-up chatter and per-call warnings go next to the responses, as in ppo-train
        # the reward workers too (they start here, and write where the driver writes)
        with engine_output_to_file(default_file.parent / "engine.log", cfg.trainer.verbose), \
                closing(validation_scorer(cfg)) as scorer:
            for i, (path, (model_dir, _, step)) in enumerate(zip(paths, targets)):
                numbered = default_file.with_suffix(f".{i}{default_file.suffix}")
                output_file = default_file if len(targets) == 1 else numbered
                tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
                records = first_per_source(load_prompts(cfg.data, tokenizer, "val"), cfg.eval.limit)
                logger.info("eval: %s with %s", decoding, "vLLM" if name == "vllm" else "Hugging Face generate")
                sampler = build_sampler(sampler_cfg, model_dir, dtype=cfg.model.dtype,
                                        max_prompt_length=max(len(r.prompt_ids) for r in records),
                                        trust_remote_code=cfg.model.trust_remote_code)
                start = time.perf_counter()
                try:
                    result = evaluate_records(lambda batch, seed: sampler.generate(batch, n, seed=seed, **sampling),
                                              records, scorer, pad_id=tokenizer.pad_token_id, n=n,
                                              seed=validation_seed(cfg.trainer.seed, step or 0),
                                              batch_size=cfg.eval.batch_size, extract=EXTRACTORS[cfg.reward.mode],
                                              output_file=output_file)
                finally:
                    sampler = None  # dropped (the lambda above holds the name, not the engine)
                    gc.collect()  # the next model's engine gets the memory
                results.append({"model": path, "step": step, **result, "temperature": temperature,
                                "seconds": time.perf_counter() - start})
    print(format_results(results, cfg.reward.mode))
    return results


def format_results(results: list[dict[str, Any]], reward_mode: str) -> str:
    """One line for one model, greedy, on one data_source; else a table with a row per model and
    data_source (and "(all)", pooled, where there are several): accuracy with its Wilson 95%
    interval when greedy, mean@n and pass@n with n samples per prompt."""
    def interval(r: dict[str, Any]) -> str:
        return "{:.3f}-{:.3f}".format(*wilson_interval(r["num_correct"], r["num_examples"]))

    def model(r: dict[str, Any]) -> str:
        return r["model"] if r["step"] is None else f"{r['model']} (step {r['step']})"

    first = results[0]
    n, temperature = first["n"], first["temperature"]
    if len(results) == 1 and n == 1 and len(first["sources"]) == 1:
        return (f"ppo-eval: accuracy {first['accuracy']:.4f} (95% CI {interval(first)}) on {first['num_examples']} "
                f"problems ({model(first)}, reward.mode={reward_mode}); responses in {first['output_file']}")
    decoding = "greedy" if temperature is None else f"{n} samples per prompt at temperature {temperature}"
    header = ("model", "data_source", "problems", *(("accuracy", "95% CI") if n == 1 else (f"mean@{n}", f"pass@{n}")),
              "mean score", "responses")
    rows = []
    for r in results:
        parts = [*r["sources"].items(), *([("(all)", r)] if len(r["sources"]) > 1 else [])]
        rows += [(model(r), name, str(part["num_examples"]), f"{part['accuracy']:.4f}",
                  interval(part) if n == 1 else f"{part['pass_at_n']:.4f}", f"{part['mean_score']:.4f}",
                  r["output_file"]) for name, part in parts]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    models = "1 model" if len(results) == 1 else f"{len(results)} models on the same problems"
    return f"ppo-eval: {models}, {decoding} (reward.mode={reward_mode})\n" + "\n".join(lines)
