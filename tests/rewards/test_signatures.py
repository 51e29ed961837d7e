"""The signatures reward functions arrive with (verl's compute_score by keyword, fn(response,
ground_truth), verl's batch reward manager, OpenRLHF's reward_func), what each is called with, the
results each may return (numbers, numpy and tensor scalars, dicts with extras, OpenRLHF's dict of
tensors), and the signatures refused with a config error."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ppo_trainer.config.schema import ConfigError, RewardConfig
from ppo_trainer.rewards.calling import Calling, Failure, RewardInput, call, classify, read_score
from ppo_trainer.rewards.scoring import build_scorer

ROWS = [RewardInput("#### 72", "72", "openai/gsm8k", {"index": 0}, "<user>Q0</user>"),
        RewardInput("#### 7", [7, 8], "math", None, "<user>Q1</user>")]


def scorer_of(tmp_path: Path, source: str, name: str = "compute_score", **options):
    path = tmp_path / f"reward_{abs(hash(source))}.py"
    path.write_text(textwrap.dedent(source))
    return build_scorer(RewardConfig(fn=f"{path}:{name}", **options))


def test_verl_compute_score_is_called_by_keyword_with_every_row_field(tmp_path):
    scorer = scorer_of(tmp_path, """
        CALLS = []
        def compute_score(ground_truth, extra_info, solution_str, data_source):  # any order: keywords
            CALLS.append((data_source, solution_str, ground_truth, extra_info))
            return 1.0
    """)
    assert scorer.calling == Calling("row", ("data_source", "solution_str", "ground_truth", "extra_info"))
    assert scorer.score(ROWS).values == [1.0, 1.0]
    assert scorer.fn.__globals__["CALLS"] == [("openai/gsm8k", "#### 72", "72", {"index": 0}),
                                              ("math", "#### 7", [7, 8], None)]


def test_verl_scorer_without_data_source_gets_what_it_names(tmp_path):
    # the shape of verl's gsm8k.compute_score: its options keep their defaults unless given
    scorer = scorer_of(tmp_path, """
        def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
            return score if solution_str.endswith(str(ground_truth)) else format_score
    """, format_score=0.25)
    assert scorer.calling == Calling("row", ("solution_str", "ground_truth"), (("format_score", 0.25),))
    assert scorer.score(ROWS).values == [1.0, 0.25]


def test_a_compute_score_with_kwargs_gets_all_four_fields(tmp_path):
    scorer = scorer_of(tmp_path, """
        def compute_score(solution_str, ground_truth, **kwargs):
            return float(sorted(kwargs) == ["data_source", "extra_info"])
    """)
    assert scorer.score(ROWS).values == [1.0, 1.0]


def test_two_required_positional_parameters_are_response_and_ground_truth(tmp_path):
    scorer = scorer_of(tmp_path, """
        def reward(text, answer, scale=2.0):
            return scale * (text == "#### " + str(answer))
    """, name="reward")
    assert scorer.calling == Calling("pair")
    assert scorer.score(ROWS).values == [2.0, 0.0]


def test_a_batched_verl_function_is_called_once_per_batch_with_lists(tmp_path):
    scorer = scorer_of(tmp_path, """
        CALLS = []
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos=None):
            CALLS.append((data_sources, solution_strs, ground_truths, extra_infos))
            return [{"score": 1.0, "acc": True}, 0.5]
    """, batched=True)
    scores = scorer.score(ROWS)
    assert scorer.fn.__globals__["CALLS"] == [(["openai/gsm8k", "math"], ["#### 72", "#### 7"], ["72", [7, 8]],
                                               [{"index": 0}, None])]
    assert scores.values == [1.0, 0.5] and scores.extras == [{"acc": 1.0}, {}]


def test_openrlhf_reward_func_gets_queries_prompts_labels_and_its_dict_of_tensors_is_read(tmp_path):
    scorer = scorer_of(tmp_path, """
        import torch
        CALLS = []
        def reward_func(queries, prompts, labels, **kwargs):
            CALLS.append((queries, prompts, labels))
            rewards = torch.tensor([1.0, 0.0])
            return {"rewards": rewards, "scores": rewards, "extra_logs": {"acc": rewards, "batch_size": torch.tensor(2)}}
    """, name="reward_func", batched=True)
    assert scorer.calling.kind == "openrlhf"
    scores = scorer.score(ROWS)
    assert scorer.fn.__globals__["CALLS"] == [(["<user>Q0</user>#### 72", "<user>Q1</user>#### 7"],
                                               ["<user>Q0</user>", "<user>Q1</user>"], ["72", [7, 8]])]
    assert scores.values == [1.0, 0.0]
    assert scores.extras == [{"scores": 1.0, "acc": 1.0, "batch_size": 2.0}, {"scores": 0.0, "acc": 0.0, "batch_size": 2.0}]
    assert scores.extra_means() == {"scores": 0.5, "acc": 0.5, "batch_size": 2.0}


def test_openrlhf_rewards_alone_are_the_scores():
    assert call(lambda queries, prompts, labels: torch.tensor([0.5, 1.0]), Calling("openrlhf"), ROWS) == [
        (0.5, {}), (1.0, {})]


def test_a_dict_return_gives_the_score_and_named_extras():
    assert read_score({"score": 0.9, "acc": True, "format": np.float32(0.5), "pred": "72", "note": None}) == (
        0.9, {"acc": 1.0, "format": 0.5, "pred": "72", "note": None})


@pytest.mark.parametrize("value", [np.float64(0.25), np.float32(0.25), np.array(0.25), torch.tensor(0.25),
                                   torch.tensor(0.25, dtype=torch.bfloat16), 0.25])
def test_numpy_and_zero_dimensional_tensor_scalars_are_numbers(value):
    assert read_score(value) == (0.25, {})


@pytest.mark.parametrize(("value", "reason"), [
    (True, "returned True as the score; a score must be a finite number"),
    (float("nan"), "returned nan as the score"),
    (torch.tensor([1.0, 2.0]), "as the score; a score must be a finite number"),
    ({"acc": 1.0}, "returned a dict without 'score' (keys ['acc'])"),
    ({"score": 1.0, "errors": 0}, "returned the extra 'errors', a reserved name"),
    ({"score": 1.0, "model": 0.3}, "returned the extra 'model', a reserved name"),
    ({"score": 1.0, "acc": "yes"}, "returned acc='yes'; 'acc' (validation's correctness) must be a number or a bool"),
])
def test_a_bad_return_fails_the_row_with_its_reason(value, reason):
    (outcome,) = call(lambda response, ground_truth: value, Calling("pair"), ROWS[:1])
    assert isinstance(outcome, Failure) and reason in outcome.reason


def test_a_batch_result_of_the_wrong_length_fails_every_row():
    outcomes = call(lambda solution_strs, ground_truths: [1.0], Calling("batch", ("solution_strs", "ground_truths")), ROWS)
    assert outcomes == [Failure("ValueError: returned 1 values as scores for a batch of 2 rows; return one per row")] * 2


@pytest.mark.parametrize(("source", "batched", "fragment"), [
    ("def f(a, b, c):\n    return 0.0\n", False, "its parameters (a, b, c) match no per-row signature"),
    ("def f(*args):\n    return 0.0\n", False, "its parameters (args) match no per-row signature"),
    ("def f(response):\n    return 0.0\n", False, "match no per-row signature"),
    ("def f(data_sources, solution_strs, ground_truths):\n    return [0.0]\n", False,
     "match no per-row signature (a batch function: set reward.batched=true)"),
    ("def f(queries, prompts, labels):\n    return [0.0]\n", False, "(a batch function: set reward.batched=true)"),
    ("def f(response, ground_truth):\n    return 0.0\n", True,
     "match no batch signature (a per-row function: set reward.batched=false)"),
    ("def f(data_source, solution_str):\n    return 0.0\n", False, "its parameters (data_source, solution_str) lack "
     "'ground_truth'"),
    ("def f(solution_str, ground_truth, tokenizer):\n    return 0.0\n", False, "require 'tokenizer', which the trainer "
     "cannot pass (give them defaults)"),
])
def test_a_signature_that_matches_none_is_a_config_error_naming_the_accepted_ones(tmp_path, source, batched, fragment):
    path = tmp_path / "bad.py"
    path.write_text(source)
    with pytest.raises(ConfigError) as err:
        build_scorer(RewardConfig(fn=f"{path}:f", batched=batched))
    message = str(err.value)
    assert message.startswith(f"'reward.fn' is '{path}:f' (reward.batched={str(batched).lower()}), but ")
    assert fragment in message
    assert "fn(data_source, solution_str, ground_truth, extra_info) by keyword" in message
    assert "fn(queries, prompts, labels, **kwargs) (OpenRLHF's reward_func)" in message and "\n" not in message


def test_a_builtin_without_a_readable_signature_is_refused():
    with pytest.raises(ValueError, match="signature cannot be read"):
        classify(max, batched=False, given={})
