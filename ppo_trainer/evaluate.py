"""`evaluate_records`: the one evaluation, of the trainer's validation and of `ppo-eval` (cli.py),
and the figures and table of its results. A response is correct when the reward function's "acc" says so, or, without one, when it
scores at least `reward.correct_score` (`rewards.scoring.Accuracy`); with eval.n samples per prompt
the accuracy is mean@n (correct responses over responses) and pass@n the share of prompts with at
least one correct response, pooled and per data_source."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ppo_trainer.batch import Batch
from ppo_trainer.data import PromptRecord
from ppo_trainer.rewards.calling import RewardInput
from ppo_trainer.rewards.math import extract_strict
from ppo_trainer.rewards.scoring import Scorer
from ppo_trainer.rollout.base import prompts_to_batch

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
    step's training samples (`run.pipeline.step_seed`)."""
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
        if out.turn_rewards is not None:  # a multi-turn episode's environment rewards add to its score, as in training
            scores.values = [v + r for v, r in zip(scores.values, out.turn_rewards.sum(dim=1).tolist())]
        for row, (response, score, extras, truncated) in enumerate(zip(out.response_text, scores.values, scores.extras,
                                                                       out.truncated.tolist())):
            record = chunk[row // n]
            rows.append({"data_source": record.data_source, "index": record.index, "sample": row % n,
                         "question": record.question, "prompt": record.prompt, "response": response,
                         **({} if out.episodes is None else {"turns": out.episodes[row]["turns"]}),
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
