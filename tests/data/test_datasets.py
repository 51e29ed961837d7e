"""Loading prompts from files, the hub and the generator: records, bad rows, filters, errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from ppo_trainer.config import ArithmeticConfig, DataConfig, DigitsConfig
from ppo_trainer.data import DataError, PromptRecord, load_prompts
from ppo_trainer.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _files_cfg(train: Path, **overrides: Any) -> DataConfig:
    return DataConfig(source="files", train_files=[str(train)], **overrides)


ROWS = [
    {"question": "Ann has 2 pens and buys 3 more. How many pens?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "A box holds 1,000 beads; 1 is lost. How many are left?", "answer": "#### 999"},
    {"question": "What is 7 times 8?", "answer": 56},
]


def test_jsonl_rows_become_templated_tokenized_records(tmp_path: Path, tokenizer: Any) -> None:
    records = load_prompts(_files_cfg(_write_jsonl(tmp_path / "t.jsonl", ROWS)), tokenizer, "train")
    assert [r.ground_truth for r in records] == ["5", "999", "56"]
    assert [r.index for r in records] == [0, 1, 2]
    first = records[0]
    assert first.question == ROWS[0]["question"]
    assert first.prompt.startswith("<|im_start|>user\nAnn has 2 pens") and first.prompt.endswith("<|im_start|>assistant\n")
    assert 'output the final answer after "####".' in first.prompt
    assert list(first.prompt_ids) == tokenizer(first.prompt, add_special_tokens=False).input_ids


def test_parquet_files_and_custom_columns(tmp_path: Path, tokenizer: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"problem": ["1 + 1?", "2 + 2?"], "solution": ["#### 2", "#### 4"]}), path)
    cfg = _files_cfg(path, prompt_key="problem", answer_key="solution", use_chat_template=False)
    records = load_prompts(cfg, tokenizer, "train")
    assert [(r.question, r.ground_truth) for r in records] == [("1 + 1?", "2"), ("2 + 2?", "4")]
    assert records[0].prompt == '1 + 1? Let\'s think step by step and output the final answer after "####".'


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        ('{"question": "unterminated', "invalid JSON"),
        ({"answer": "#### 3"}, "missing key 'question'"),
        ({"question": 12, "answer": "#### 3"}, "'question' must be a non-empty string, got int"),
        ({"question": "Q?", "answer": None}, "'answer' must be a string or a number"),
        ({"question": "Q?", "answer": "####"}, "nothing after '####'"),
        ('["a", "list"]', "expected an object"),
    ],
)
def test_malformed_row_stops_the_run_naming_file_and_line(
    tmp_path: Path, tokenizer: Any, bad_line: Any, reason: str
) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], "", bad_line, ROWS[1]])
    with pytest.raises(DataError) as err:
        load_prompts(_files_cfg(path), tokenizer, "train")
    assert str(err.value).startswith(f"{path}:3: ")
    assert reason in str(err.value) and "data.bad_rows=skip" in str(err.value)
    assert "\n" not in str(err.value)


def test_skip_mode_counts_malformed_rows_and_keeps_row_numbers(
    tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], "{oops", {"question": 1, "answer": 2}, ROWS[1], {"q": 1}])
    with caplog.at_level(logging.WARNING, logger="ppo_trainer"):
        records = load_prompts(_files_cfg(path, bad_rows="skip"), tokenizer, "train")
    assert [r.index for r in records] == [0, 3]
    assert f"skipped 3 malformed train rows of {path}" in caplog.text
    assert f"the first: {path}:2: invalid JSON" in caplog.text


def test_long_prompts_are_dropped_with_a_logged_count(
    tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [{"question": "Q" * n, "answer": "#### 1"} for n in (10, 500, 20, 600)]
    cfg = _files_cfg(_write_jsonl(tmp_path / "t.jsonl", rows), max_prompt_length=200)
    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        records = load_prompts(cfg, tokenizer, "train")
    assert [r.index for r in records] == [0, 2]
    assert all(len(r.prompt_ids) <= 200 for r in records)
    assert "dropped 2 of 4 train prompts longer than data.max_prompt_length=200 tokens" in caplog.text


def test_split_emptied_by_the_length_filter_names_file_and_filter(tmp_path: Path, tokenizer: Any) -> None:
    path = _write_jsonl(tmp_path / "t.jsonl", [{"question": "Q" * 500, "answer": "#### 1"}])
    with pytest.raises(DataError, match=rf"{path}: no train prompts left .*1 longer than data.max_prompt_length=100"):
        load_prompts(_files_cfg(path, max_prompt_length=100), tokenizer, "train")


def test_split_emptied_by_skipped_rows_is_an_error(tmp_path: Path, tokenizer: Any) -> None:
    path = _write_jsonl(tmp_path / "t.jsonl", ["not json"])
    with pytest.raises(DataError, match="no train prompts left .*1 malformed and skipped"):
        load_prompts(_files_cfg(path, bad_rows="skip"), tokenizer, "train")


def test_missing_file_names_the_file_and_the_key(tmp_path: Path, tokenizer: Any) -> None:
    cfg = DataConfig(source="files", train_files=[str(tmp_path / "t.jsonl")], val_files=[str(tmp_path / "nope.jsonl")])
    with pytest.raises(DataError, match=rf"^data.val_files: file not found: {tmp_path / 'nope.jsonl'}$"):
        load_prompts(cfg, tokenizer, "val")


def test_unsupported_file_type_is_rejected(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "t.csv"
    path.write_text("question,answer\n")
    with pytest.raises(DataError, match="data.train_files: .*t.csv is neither .jsonl nor .parquet"):
        load_prompts(_files_cfg(path), tokenizer, "train")


def test_files_source_without_val_files_says_how_to_pass_them(tmp_path: Path, tokenizer: Any) -> None:
    cfg = _files_cfg(_write_jsonl(tmp_path / "t.jsonl", ROWS))
    with pytest.raises(DataError, match=r"data.val_files is empty; .*data.val_files=\[test.jsonl\]"):
        load_prompts(cfg, tokenizer, "val")


def test_uncached_hub_dataset_offline_says_how_to_pass_local_files(tokenizer: Any) -> None:
    cfg = DataConfig(source="openai/gsm8k", hub_config="main")
    with pytest.raises(DataError) as err:
        load_prompts(cfg, tokenizer, "train")
    message = str(err.value)
    assert message.startswith("data.source=openai/gsm8k (config main, split train) is not in the local Hugging Face cache")
    assert "data.source=files data.train_files=[train.jsonl] data.val_files=[test.jsonl]" in message
    assert "\n" not in message


def test_arithmetic_source_gives_the_frozen_validation_set(tokenizer: Any) -> None:
    cfg = DataConfig(source="arithmetic", arithmetic=ArithmeticConfig(train_size=50))
    val = load_prompts(cfg, tokenizer, "val")
    train = load_prompts(cfg, tokenizer, "train")
    assert len(val) == 256 and len(train) == 50
    assert {r.question for r in val}.isdisjoint(r.question for r in train)
    assert all(isinstance(r, PromptRecord) and r.ground_truth.isdigit() for r in val)


def test_digits_source_gives_one_token_per_character_prompts(tokenizer: Any) -> None:
    cfg = DataConfig(source="digits", prompt_template="{question}", instruction="", use_chat_template=False,
                     digits=DigitsConfig(task="reverse", length=3, train_size=40, val_size=8))
    val, train = load_prompts(cfg, tokenizer, "val"), load_prompts(cfg, tokenizer, "train")
    assert len(val) == 8 and len(train) == 40
    first = val[0]
    assert first.prompt == first.question and first.prompt.endswith("=") and len(first.prompt_ids) == 4
    assert first.ground_truth == first.question[2::-1]
    with pytest.raises(DataError, match="data.digits: found only 3 distinct held-out strings of 1 digits"):
        load_prompts(DataConfig(source="digits", digits=DigitsConfig(length=1)), tokenizer, "val")


def test_gsm8k_train_file_loads(gsm8k_dir: Path, tokenizer: Any) -> None:
    records = load_prompts(_files_cfg(gsm8k_dir / "train.jsonl", max_prompt_length=1024), tokenizer, "train")
    assert len(records) > 7000
    assert records[0].ground_truth == "72"


def test_missing_chat_template_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="set data.use_chat_template=false"):
        load_prompts(_files_cfg(_write_jsonl(tmp_path / "t.jsonl", ROWS)), tokenizer, "train")
