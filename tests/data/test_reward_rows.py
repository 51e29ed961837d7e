"""Rows the reward cannot use are refused at load, before any model loads, naming file and line:
a null ground truth whenever a reward function reads answers, and what the built-in math reward
cannot read (nothing after "####", objects, bools, nested lists); values JSON cannot hold (parquet's
timestamps, dates, decimals, bytes) become text at load; a generated row names itself in a
reward failure."""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from ppo_trainer.config.schema import ArithmeticConfig, DataConfig, PPOConfig
from ppo_trainer.data import DataError, load_prompts
from ppo_trainer.data.datasets import json_value
from ppo_trainer.evaluate import evaluate_records, reward_inputs
from ppo_trainer.models.loading import load_tokenizer
from ppo_trainer.rewards.calling import Calling, Failure
from ppo_trainer.rewards.loader import answer_check
from ppo_trainer.rewards.scoring import FunctionScorer, failure_line
from ppo_trainer.rollout.base import assemble_rollout


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def verl_row(i: int, truth: Any) -> dict[str, Any]:
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": i}}


def plain_row(i: int, answer: Any) -> dict[str, Any]:
    return {"question": f"What is {i} + 1?", "answer": answer}


def files(path: Path, **overrides: Any) -> DataConfig:
    """Data read from `path` on both splits."""
    return DataConfig(source="files", train_files=[str(path)], val_files=[str(path)], **overrides)


def config(**reward: Any) -> Any:
    """The full config with reward.* and eval.reward_fn as given (eval_reward_fn)."""
    cfg = OmegaConf.structured(PPOConfig)
    cfg.eval.reward_fn = reward.pop("eval_reward_fn", None)
    for key, value in reward.items():
        cfg.reward[key] = value
    return cfg


# --- through ppo-train: each stops with exit 2 and one line before any model loads


def test_ppo_train_refuses_a_verl_row_with_a_null_ground_truth_naming_file_and_line(ppo_train_error, tmp_path,
                                                                                      no_model_loading):
    rows = write_jsonl(tmp_path / "train.jsonl", [verl_row(0, "1"), verl_row(1, None), verl_row(2, "3")])
    line = ppo_train_error(f"data.train_files=[{rows}]")
    assert line == (f"ppo-train: input error: {rows}:2: 'reward_model.ground_truth' is null, but the reward "
                    "function (reward.fn, eval.reward_fn) reads it; fix the row or set data.bad_rows=skip to skip "
                    "malformed rows")


def test_ppo_train_refuses_an_answer_with_nothing_after_the_marker_for_the_math_reward(ppo_train_error, tmp_path,
                                                                                          no_model_loading):
    rows = write_jsonl(tmp_path / "train.jsonl", [plain_row(0, "#### 1"), plain_row(1, "so the answer is #### ")])
    line = ppo_train_error(f"data.train_files=[{rows}]")
    assert line == (f"ppo-train: input error: {rows}:2: reward.fn=ppo_trainer.rewards.math:score cannot read it: "
                    "ground truth 'so the answer is #### ' has nothing after '####'; fix the row or set "
                    "data.bad_rows=skip to skip malformed rows")


# --- a null ground truth


def test_a_null_ground_truth_is_refused_whenever_the_answer_is_required(tmp_path, tokenizer):
    verl = write_jsonl(tmp_path / "verl.jsonl", [verl_row(0, "1"), verl_row(1, None)])
    plain = write_jsonl(tmp_path / "plain.jsonl", [plain_row(0, None)])
    with pytest.raises(DataError, match=rf"^{verl}:2: 'reward_model.ground_truth' is null, but the reward "
                                  r"function \(reward.fn, eval.reward_fn\) reads it;"):
        load_prompts(files(verl), tokenizer, "train")
    with pytest.raises(DataError, match=rf"^{plain}:1: 'answer' is null, but the reward function"):
        load_prompts(files(plain), tokenizer, "train")


def test_a_null_ground_truth_loads_as_none_when_no_reward_function_reads_answers(tmp_path, tokenizer):
    rows = write_jsonl(tmp_path / "rlhf.jsonl", [plain_row(0, None), {"question": "Say hi."}])
    records = load_prompts(files(rows), tokenizer, "train", require_answer=False)
    assert [r.ground_truth for r in records] == [None, None]


def test_null_ground_truths_are_skipped_and_counted_with_bad_rows_skip(tmp_path, tokenizer, caplog):
    rows = write_jsonl(tmp_path / "t.jsonl", [verl_row(0, "1"), verl_row(1, None), verl_row(2, None), verl_row(3, "4")])
    with caplog.at_level(logging.WARNING, logger="ppo_trainer"):
        records = load_prompts(files(rows, bad_rows="skip"), tokenizer, "train")
    assert [r.ground_truth for r in records] == ["1", "4"]
    assert f"skipped 2 malformed train rows of {rows} (data.bad_rows=skip); the first: {rows}:2: " \
           "'reward_model.ground_truth' is null" in caplog.text


# --- what the built-in math reward cannot read


def test_the_math_reward_checks_the_split_it_scores_and_a_custom_reward_none():
    math_fn = "ppo_trainer.rewards.math:score"
    assert answer_check(config(), "train") is not None and answer_check(config(), "val") is not None
    custom = config(fn="my_rewards.py:compute_score")
    assert (answer_check(custom, "train"), answer_check(custom, "val")) == (None, None)
    judged = config(fn="my_rewards.py:compute_score", eval_reward_fn=math_fn)  # trains on custom, validates by math
    assert answer_check(judged, "train") is None and answer_check(judged, "val") is not None
    trained = config(eval_reward_fn="my_rewards.py:judge")
    assert answer_check(trained, "train") is not None and answer_check(trained, "val") is None
    assert answer_check(config(fn=None), "train") is None


@pytest.mark.parametrize(("truth", "reason"), [
    ("#### ", "ground truth '#### ' has nothing after '####'"),
    ("42 ####", "ground truth '42 ####' has nothing after '####'"),
    ({"answer": 3}, "the math reward reads a string, a number or a list of them, not dict {'answer': 3}"),
    (True, "the math reward reads a string, a number or a list of them, not bool True"),
    ([["#### 8"]], "the math reward reads a string, a number or a list of them, not list ['#### 8'] inside a list"),
    ([], "[] is an empty list: no answer to compare"),
], ids=["marker and a space", "marker at the end", "an object", "a bool", "a nested list", "an empty list"])
def test_the_math_reward_refuses_at_load_what_it_cannot_read(tmp_path, tokenizer, truth, reason):
    rows = write_jsonl(tmp_path / "t.jsonl", [verl_row(0, "1"), verl_row(1, truth)])
    with pytest.raises(DataError) as error:
        load_prompts(files(rows), tokenizer, "train", check_answer=answer_check(config(), "train"))
    assert str(error.value) == (f"{rows}:2: reward.fn=ppo_trainer.rewards.math:score cannot read it: {reason}; "
                                "fix the row or set data.bad_rows=skip to skip malformed rows")


def test_a_custom_reward_fn_gets_any_ground_truth_format(tmp_path, tokenizer):
    truths = ["#### ", {"answer": 3}, [["#### 8"]], True]
    rows = write_jsonl(tmp_path / "t.jsonl", [verl_row(i, t) for i, t in enumerate(truths)])
    check = answer_check(config(fn="my_rewards.py:compute_score"), "train")
    records = load_prompts(files(rows), tokenizer, "train", check_answer=check)
    assert [r.ground_truth for r in records] == truths


def test_math_answers_the_reward_can_read_load(tmp_path, tokenizer):
    truths = ["#### 72", "1,600", 7, 2.5, ["1,000", 7]]
    rows = write_jsonl(tmp_path / "t.jsonl", [verl_row(i, t) for i, t in enumerate(truths)])
    records = load_prompts(files(rows), tokenizer, "train", check_answer=answer_check(config(), "train"))
    assert [r.ground_truth for r in records] == truths


# --- values JSON cannot hold


EXTRA = {"created": datetime.datetime(2024, 3, 1, 12, 30, 5), "day": datetime.date(2024, 3, 1),
         "price": decimal.Decimal("12.50"), "blob": b"\x00\xffhi", "tags": ["a", "b"], "n": 3}
EXTRA_AS_TEXT = {"created": "2024-03-01T12:30:05", "day": "2024-03-01", "price": "12.50",
                 "blob": base64.b64encode(b"\x00\xffhi").decode(), "tags": ["a", "b"], "n": 3}


def write_parquet(path: Path) -> Path:
    """verl rows whose extra_info holds a timestamp, a date, a decimal and bytes (pyarrow's own
    types), and whose ground truth is a decimal."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    extra = pa.struct([("created", pa.timestamp("us")), ("day", pa.date32()), ("price", pa.decimal128(6, 2)),
                       ("blob", pa.binary()), ("tags", pa.list_(pa.string())), ("n", pa.int64())])
    table = pa.table({
        "data_source": ["shop", "shop"],
        "prompt": [[{"role": "user", "content": "What does it cost?"}], [{"role": "user", "content": "And now?"}]],
        "reward_model": pa.array([{"ground_truth": decimal.Decimal(d)} for d in ("12.50", "3.00")],
                                 pa.struct([("ground_truth", pa.decimal128(6, 2))])),
        "extra_info": pa.array([EXTRA, {**EXTRA, "blob": b"", "n": 4}], extra),
    })
    pq.write_table(table, path)
    return path


def test_parquet_timestamps_dates_decimals_and_bytes_load_as_json_text(tmp_path, tokenizer, caplog):
    path = write_parquet(tmp_path / "shop.parquet")
    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        records = load_prompts(files(path), tokenizer, "train", check_answer=answer_check(config(), "train"))
    assert records[0].extra_info == EXTRA_AS_TEXT
    assert records[1].extra_info == {**EXTRA_AS_TEXT, "blob": "", "n": 4}
    assert [r.ground_truth for r in records] == ["12.50", "3.00"]  # a decimal's exact text, which the math reward reads
    assert json.loads(json.dumps({"extra_info": records[0].extra_info}))["extra_info"] == EXTRA_AS_TEXT
    conversions = [r.getMessage() for r in caplog.records if "JSON cannot hold" in r.getMessage()]
    assert conversions == [f"data: converted 10 values JSON cannot hold to text in {path} (first: "
                           "reward_model.ground_truth, a Decimal): ISO 8601 dates and times, decimals as written, "
                           "bytes as base64; the reward function gets the text"]


def test_a_validation_of_parquet_rows_with_a_timestamp_writes_its_generations(tmp_path, tokenizer):
    records = load_prompts(files(write_parquet(tmp_path / "shop.parquet")), tokenizer, "val")

    def generate(batch, seed):
        texts = ["#### 12.50", "#### 2"]
        ids = [[7, 8] for _ in texts]
        return assemble_rollout(batch, 1, ids, [[-0.5, -0.5] for _ in ids], [False, False], texts, pad_id=0)

    def contains_truth(response: str, ground_truth: Any) -> float:
        return float(str(ground_truth) in response)

    out = tmp_path / "val_generations" / "step_0.jsonl"
    result = evaluate_records(generate, records, FunctionScorer(contains_truth, Calling("pair")), pad_id=0,
                              output_file=out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["accuracy"] == 0.5
    assert [row["extra_info"]["created"] for row in rows] == ["2024-03-01T12:30:05"] * 2


def test_json_value_turns_numpy_scalars_into_numbers_and_other_values_into_text():
    value, converted = json_value({"a": [np.int64(3), np.float32(0.5), datetime.time(9, 5)], "b": None}, "extra_info")
    assert value == {"a": [3, 0.5, "09:05:00"], "b": None}
    assert type(value["a"][0]) is int
    assert converted == [("extra_info.a[2]", "time")]


# --- a generated row names itself in a failure


def test_a_generated_rows_reward_failure_names_the_generator_and_row(tokenizer):
    cfg = DataConfig(source="arithmetic", arithmetic=ArithmeticConfig(train_size=4, val_size=4))
    record = load_prompts(cfg, tokenizer, "train")[2]
    row = reward_inputs([record], 1, ["#### 5"])[0]
    assert record.where == "arithmetic[train] row 2" and row.where == record.where
    assert failure_line(0, row, Failure("ValueError: no")).startswith(
        "reward function failed on row 0 (arithmetic[train] row 2, data_source arithmetic, ground truth")
