"""The CPU recipe's data (`+experiment=gsm8k_cpu`): today's one-step validation set and a harder
one (data.arithmetic.hard_val_size), each reported under its own data_source; prompts that fit the recipe's prompt budget whatever
the curriculum and instruction; a longer response budget that the config and the strict reward take."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from omegaconf import OmegaConf

from ppo_trainer.batch import Batch
from ppo_trainer.config.composition import compose
from ppo_trainer.config.schema import DataConfig
from ppo_trainer.data import load_prompts
from ppo_trainer.data.arithmetic import HARD_SOURCE, SOURCE
from ppo_trainer.data.datasets import describe_split
from ppo_trainer.evaluate import evaluate_records, validation_metrics
from ppo_trainer.models.loading import load_tokenizer
from ppo_trainer.rewards.scoring import build_scorer
from ppo_trainer.rollout.base import assemble_rollout

RECIPE = "+experiment=gsm8k_cpu"
TODAYS_VAL = "7d8703fe454be3a4"  # tests/data/test_arithmetic.py TODAY[(10, 0.0)]: the recipe's set before this change
GSM8K_INSTRUCTION = DataConfig().instruction  # "Let's think step by step and output the final answer after "####"."
GSM8K_OVERRIDE = 'data.instruction="{}"'.format(GSM8K_INSTRUCTION.replace('"', '\\"'))  # as a shell passes it


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("embedded:smollm2-135m-instruct")


def _data(*overrides: str) -> DataConfig:
    return OmegaConf.to_object(compose([RECIPE, *overrides]).data)


def test_the_recipe_validates_on_todays_one_step_set_and_a_hard_set(tokenizer: Any) -> None:
    records = load_prompts(_data(), tokenizer, "val")
    by_source = {name: [r for r in records if r.data_source == name] for name in (SOURCE, HARD_SOURCE)}
    assert [len(rows) for rows in by_source.values()] == [256, 128] and len(records) == 384
    todays = [{"question": r.question, "answer": r.ground_truth} for r in by_source[SOURCE]]
    assert hashlib.sha256(json.dumps(todays).encode()).hexdigest()[:16] == TODAYS_VAL
    assert {r.where.rpartition(" row ")[0] for r in records} == {"arithmetic[val]", "arithmetic/hard[val]"}
    assert describe_split(_data(), "val") == (
        "the arithmetic generator: arithmetic (256 problems, one operation each, numbers up to 10) and "
        "arithmetic/hard (128 problems, two operations each, numbers up to 20)")


def test_a_new_curriculum_leaves_the_recipes_validation_sets_as_they_are(tokenizer: Any) -> None:
    before = load_prompts(_data(), tokenizer, "val")
    after = load_prompts(_data("data.arithmetic.max_operand=50", "data.arithmetic.two_step_fraction=0.5",
                               "data.arithmetic.operations=[+,-,*]", "data.arithmetic.seed=3"), tokenizer, "val")
    assert [(r.data_source, r.question, r.ground_truth) for r in after] == \
        [(r.data_source, r.question, r.ground_truth) for r in before]


@pytest.mark.parametrize("instruction", [None, GSM8K_INSTRUCTION])
def test_every_prompt_fits_the_recipes_prompt_budget_with_either_instruction(tokenizer: Any,
                                                                             instruction: str | None) -> None:
    """Numbers up to 100 and two operations on every training problem, under the recipe's
    instruction and GSM8K's: none of them is dropped by data.max_prompt_length=128."""
    overrides = ["data.overlong_prompts=error", "data.arithmetic.max_operand=100",
                 "data.arithmetic.two_step_fraction=1", "data.arithmetic.train_size=2000",
                 "data.arithmetic.hard_max_operand=100"]
    cfg = _data(*overrides, *([GSM8K_OVERRIDE] if instruction else []))
    assert cfg.instruction == (instruction or _data().instruction)
    records = load_prompts(cfg, tokenizer, "train") + load_prompts(cfg, tokenizer, "val")
    assert cfg.max_prompt_length == 128 and len(records) == 2000 + 384
    assert max(len(r.prompt_ids) for r in records) <= 80  # measured: 70 with GSM8K's instruction
    assert all(r.prompt.rstrip().endswith("<|im_start|>assistant") for r in records)


def test_a_longer_response_budget_is_accepted_by_the_recipe() -> None:
    cfg = compose([RECIPE, "sampler.max_new_tokens=512", "eval.max_new_tokens=1024", GSM8K_OVERRIDE])
    assert (cfg.sampler.max_new_tokens, cfg.eval.max_new_tokens, cfg.data.instruction) == (512, 1024, GSM8K_INSTRUCTION)


class Oracle:
    """Answers the hard set's problems with a worked, step-by-step response longer than the recipe's
    48 tokens (its ground truth's working in words, then "#### N" and a closing sentence with
    another number) and the one-step set's with the right working cut before its "####", as a
    response that runs out of tokens is."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def generate(self, batch: Batch, seed: int) -> Batch:
        texts = [self.response(truth, source) for truth, source in zip(batch.ground_truth, batch.data_source)]
        ids = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        self.lengths += [len(row) for row in ids]
        return assemble_rollout(batch, 1, ids, [[-0.5] * len(row) for row in ids], [False] * len(ids), texts, pad_id=0)

    @staticmethod
    def response(truth: str, source: str) -> str:
        *steps, final = truth.splitlines()
        if source == SOURCE:
            return "Let's think step by step. " + " ".join(steps)
        words = " ".join(f"Step {i + 1}: we compute {step}, so that is the running total."
                         for i, step in enumerate(steps))
        return f"Let's think step by step. {words}\nSo the final answer is\n{final}\nI hope this helps with 2 steps."


def test_validation_reports_each_set_under_its_own_name_with_long_worked_answers_scored(tokenizer: Any) -> None:
    cfg = compose([RECIPE])
    records = load_prompts(OmegaConf.to_object(cfg.data), tokenizer, "val")
    oracle = Oracle(tokenizer)
    result = evaluate_records(oracle.generate, records, build_scorer(cfg.reward), pad_id=tokenizer.pad_token_id,
                              batch_size=cfg.eval.batch_size)
    metrics = validation_metrics(result)
    assert metrics["val/arithmetic/hard/accuracy"] == 1.0 and metrics["val/arithmetic/accuracy"] == 0.0
    assert metrics["val/accuracy"] == pytest.approx(128 / 384)  # pooled over both sets
    assert set(metrics) == {"val/accuracy", "val/score/mean", "val/arithmetic/accuracy", "val/arithmetic/score/mean",
                            "val/arithmetic/hard/accuracy", "val/arithmetic/hard/score/mean"}
    assert min(oracle.lengths[256:]) > cfg.eval.max_new_tokens  # the hard set's responses outrun the 64-token budget
