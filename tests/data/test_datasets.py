"""Loading prompts from files, the hub and the generator: layouts (ours, verl's, OpenRLHF's),
records, bad rows, the length filter, errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from ppo_trainer.config.schema import ArithmeticConfig, DataConfig, DigitsConfig
from ppo_trainer.data import DataError, PromptRecord, load_prompts
from ppo_trainer.data.datasets import describe_split
from ppo_trainer.evaluate import prompt_batch
from ppo_trainer.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _write_jsonl(path: Path, lines: list[Any]) -> Path:
    """Objects as JSON, strings and bytes (e.g. not UTF-8) as they are, one per line."""
    encoded = (line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode()
               for line in lines)
    path.write_bytes(b"".join(line + b"\n" for line in encoded))
    return path


def _files_cfg(train: Path, **overrides: Any) -> DataConfig:
    return DataConfig(source="files", train_files=[str(train)], **overrides)


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def verl_row(i: int, question: str, truth: str, source: str = "openai/gsm8k", system: str | None = None) -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"data_source": source, "prompt": turns, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": i, "answer": f"... #### {truth}", "question": question}}


ROWS = [
    {"question": "Ann has 2 pens and buys 3 more. How many pens?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "A box holds 1,000 beads; 1 is lost. How many are left?", "answer": "#### 999"},
    {"question": "What is 7 times 8?", "answer": 56},
]


def test_jsonl_rows_become_templated_tokenized_records(tmp_path: Path, tokenizer: Any) -> None:
    records = load_prompts(_files_cfg(_write_jsonl(tmp_path / "t.jsonl", ROWS)), tokenizer, "train")
    assert [r.ground_truth for r in records] == ["2 + 3 = 5\n#### 5", "#### 999", 56]  # as in the data
    assert [r.index for r in records] == [0, 1, 2]
    assert {r.data_source for r in records} == {"t"} and {r.extra_info for r in records} == {None}
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
    assert [(r.question, r.ground_truth) for r in records] == [("1 + 1?", "#### 2"), ("2 + 2?", "#### 4")]
    assert records[0].prompt == '1 + 1? Let\'s think step by step and output the final answer after "####".'


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        ('{"question": "unterminated', "invalid JSON"),
        ({"answer": "#### 3"}, "missing key 'question'"),
        ({"question": 12, "answer": "#### 3"}, "'question' must be a non-empty string or a list of chat messages"),
        ({"question": " ", "answer": "#### 3"}, "'question' is an empty string"),
        ({"question": "Q?", "answer": "#### 3", "data_source": 7},
         "'data_source' (data.source_key) must be a non-empty string"),
        ({"question": [{"role": "system", "content": "S"}], "answer": "3"},
         "'question' has no user turn (roles: system)"),
        ({"question": [{"role": "user", "content": [{"type": "text"}]}], "answer": "3"},
         "'question' message 0 (user) has content of type list"),
        ({"question": [{"content": "hi"}], "answer": "3"},
         "'question' message 0 must be an object with a string 'role'"),
        (b'{"question": "caf\xe9?", "answer": "3"}', "not UTF-8 text (byte 0xe9 at byte 18 of the line)"),
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
    assert "dropped 2 of 4 train prompts of data_source t longer than data.max_prompt_length=200 tokens" in caplog.text


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
    assert "pass local files: data.train_files=[train.jsonl] data.val_files=[test.jsonl]" in message
    assert "\n" not in message


def test_arithmetic_source_gives_the_frozen_validation_set(tokenizer: Any) -> None:
    cfg = DataConfig(source="arithmetic", arithmetic=ArithmeticConfig(train_size=50))
    val = load_prompts(cfg, tokenizer, "val")
    train = load_prompts(cfg, tokenizer, "train")
    assert len(val) == 256 and len(train) == 50
    assert {r.question for r in val}.isdisjoint(r.question for r in train)
    assert all(isinstance(r, PromptRecord) and r.ground_truth.rpartition("#### ")[2].isdigit() for r in val)
    assert {r.data_source for r in val + train} == {"arithmetic"}


def test_arithmetic_hard_set_is_a_second_validation_source_named_by_row(tokenizer: Any) -> None:
    cfg = DataConfig(source="arithmetic", max_prompt_length=512,
                     arithmetic=ArithmeticConfig(train_size=50, hard_val_size=8))
    val = load_prompts(cfg, tokenizer, "val")
    assert [r.data_source for r in val] == ["arithmetic"] * 256 + ["arithmetic/hard"] * 8
    assert (val[255].where, val[256].where, val[256].origin) == (
        "arithmetic[val] row 255", "arithmetic/hard[val] row 0", "the arithmetic generator (arithmetic/hard, val)")
    assert {r.data_source for r in load_prompts(cfg, tokenizer, "train")} == {"arithmetic"}


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
    assert records[0].ground_truth.endswith("#### 72") and records[0].data_source == "train"


def test_missing_chat_template_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="set data.use_chat_template=false"):
        load_prompts(_files_cfg(_write_jsonl(tmp_path / "t.jsonl", ROWS)), tokenizer, "train")


def test_verl_layout_parquet_rows_load_as_they_are(tmp_path: Path, tokenizer: Any) -> None:
    rows = [verl_row(0, "Ann has 2 pens and buys 3. How many?", "5"),
            verl_row(1, "What is 7 x 8?", "56", system="You are a calculator.")]
    records = load_prompts(_files_cfg(_write_parquet(tmp_path / "train.parquet", rows)), tokenizer, "train")
    first, second = records
    assert (first.question, first.ground_truth, first.data_source) == (rows[0]["prompt"][0]["content"], "5",
                                                                       "openai/gsm8k")
    assert first.extra_info == rows[0]["extra_info"]
    # message prompts take neither data.instruction nor data.prompt_template
    assert first.prompt == "<|im_start|>user\nAnn has 2 pens and buys 3. How many?<|im_end|>\n<|im_start|>assistant\n"
    assert first.messages == rows[0]["prompt"]
    assert second.prompt.startswith("<|im_start|>system\nYou are a calculator.<|im_end|>\n<|im_start|>user\nWhat is 7")
    assert second.messages == rows[1]["prompt"] and second.question == "What is 7 x 8?"


def test_verl_layout_jsonl_rows_with_a_system_prompt_in_the_config(tmp_path: Path, tokenizer: Any) -> None:
    rows = [verl_row(0, "Q1?", "1"), verl_row(1, "Q2?", "2", system="Data's own system turn.")]
    path = _write_jsonl(tmp_path / "v.jsonl", rows)
    records = load_prompts(_files_cfg(path, system_prompt="Config's system turn."), tokenizer, "train")
    assert records[0].messages[0] == {"role": "system", "content": "Config's system turn."}
    assert records[1].messages[0] == {"role": "system", "content": "Data's own system turn."}  # the data's wins
    assert [len(r.messages) for r in records] == [2, 2]


def test_openrlhf_layout_by_setting_the_keys(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"input": "What is 1 + 1?", "label": "2"},
            {"input": [{"role": "user", "content": "What is 2 + 2?"}], "label": "4"}]
    cfg = _files_cfg(_write_jsonl(tmp_path / "orlhf.jsonl", rows), prompt_key="input", answer_key="label",
                     prompt_template="{question}")
    records = load_prompts(cfg, tokenizer, "train")
    assert [(r.question, r.ground_truth, r.data_source) for r in records] == [
        ("What is 1 + 1?", "2", "orlhf"), ("What is 2 + 2?", "4", "orlhf")]
    assert records[0].prompt == records[1].prompt.replace("2 + 2", "1 + 1")


def test_nested_keys_follow_the_dotted_path_and_a_dotted_column_wins(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"task": {"text": "Q?"}, "reward_model.ground_truth": "flat", "reward_model": {"ground_truth": "nested"},
             "meta": {"origin": "mine"}}]
    path = _write_jsonl(tmp_path / "n.jsonl", rows)
    cfg = _files_cfg(path, prompt_key="task.text", answer_key="reward_model.ground_truth", source_key="meta.origin")
    (record,) = load_prompts(cfg, tokenizer, "train")
    assert (record.question, record.ground_truth, record.data_source) == ("Q?", "flat", "mine")
    with pytest.raises(DataError, match=r"missing key 'task.body' \('task' has: text\)"):
        load_prompts(_files_cfg(path, prompt_key="task.body", answer_key="meta"), tokenizer, "train")


GROUND_TRUTHS = ["#### 1,600", 72, 2.5, True, None, [1, "(1, 2)"], {"answer": [3, 4], "unit": "cm"}]


def test_ground_truths_of_every_json_type_reach_the_batch_unchanged(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"question": f"Q{i}?", "answer": truth, "extra_info": {"i": i}} for i, truth in enumerate(GROUND_TRUTHS)]
    # no reward function reads answers (a null one is refused when one does: tests/data/test_reward_rows.py)
    path = _write_jsonl(tmp_path / "t.jsonl", rows)
    records = load_prompts(_files_cfg(path), tokenizer, "train", require_answer=False)
    assert [r.ground_truth for r in records] == GROUND_TRUTHS
    assert [type(r.ground_truth) for r in records] == [type(t) for t in GROUND_TRUTHS]
    batch = prompt_batch(records, pad_id=0).select([6, 6, 0])  # as the samplers repeat a prompt's rows
    assert batch.ground_truth == [GROUND_TRUTHS[6], GROUND_TRUTHS[6], "#### 1,600"]
    assert batch.extra_info == [{"i": 6}, {"i": 6}, {"i": 0}] and batch.data_source == ["t"] * 3


def test_data_source_falls_back_to_the_generator_the_file_stem_and_the_dataset_name(
    tmp_path: Path, tokenizer: Any
) -> None:
    rows = [{"question": "Q?", "answer": "1"}, {"question": "R?", "answer": "2", "data_source": "mine"},
            {"question": "S?", "answer": "3", "data_source": None}]
    path = _write_jsonl(tmp_path / "my_set.jsonl", rows)
    assert [r.data_source for r in load_prompts(_files_cfg(path), tokenizer, "train")] == ["my_set", "mine", "my_set"]
    custom = _files_cfg(path, source_key="origin")  # rows without data.source_key: the file's stem
    assert {r.data_source for r in load_prompts(custom, tokenizer, "train")} == {"my_set"}
    digits = DataConfig(source="digits", use_chat_template=False, digits=DigitsConfig(train_size=5))
    assert {r.data_source for r in load_prompts(digits, tokenizer, "train")} == {"digits"}
    folder = tmp_path / "local_dataset"  # a dataset folder that datasets.load_dataset reads offline
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", rows[:1])
    hub = DataConfig(source=str(folder), val_split="train")
    assert [r.data_source for r in load_prompts(hub, tokenizer, "val")] == [str(folder)]


def test_a_role_the_chat_template_refuses_is_a_malformed_row(tmp_path: Path, tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                               "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}{{ m['content'] }}"
                               "{% endfor %}")
    rows = [{"question": [{"role": "user", "content": "Q?"}], "answer": "1"},
            {"question": [{"role": "tool", "content": "42"}, {"role": "user", "content": "Q?"}], "answer": "1"}]
    path = _write_jsonl(tmp_path / "roles.jsonl", rows)
    with pytest.raises(DataError, match=rf"^{path}:2: the model's chat template refuses these turns \(roles: tool, "
                                         r"user\): Unknown role: tool; fix the row or set data.bad_rows=skip"):
        load_prompts(_files_cfg(path), tokenizer, "train")
    assert [r.index for r in load_prompts(_files_cfg(path, bad_rows="skip"), tokenizer, "train")] == [0]


def test_a_line_that_is_not_utf8_is_skipped_with_bad_rows_skip(tmp_path: Path, tokenizer: Any) -> None:
    path = _write_jsonl(tmp_path / "latin1.jsonl", [ROWS[0], "caf\u00e9 #### 3".encode("latin-1"), ROWS[1]])
    records = load_prompts(_files_cfg(path, bad_rows="skip"), tokenizer, "train")
    assert [r.index for r in records] == [0, 2]


def test_a_corrupt_parquet_file_is_a_data_error_naming_the_file(tmp_path: Path, tokenizer: Any) -> None:
    good = _write_parquet(tmp_path / "good.parquet", [verl_row(i, f"Q{i}?", str(i)) for i in range(20)])
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError, match=rf"^{cut}: not a readable parquet file \(.*\); the file may be cut short"):
        load_prompts(_files_cfg(cut), tokenizer, "train")


def test_overlong_prompts_are_counted_per_source_and_a_validation_loss_warns(
    tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [{"question": "Q" * n, "answer": "1", "data_source": source}
            for n, source in [(10, "a"), (500, "a"), (600, "a"), (20, "b"), (700, "b")]]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        records = load_prompts(DataConfig(val_files=[str(path)], max_prompt_length=200), tokenizer, "val")
    assert [(r.index, r.data_source) for r in records] == [(0, "a"), (3, "b")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "data: dropped 2 of 3 val prompts of data_source a longer than data.max_prompt_length=200 tokens "
        "(data.overlong_prompts=drop); val/a/* count the 1 that fit",
        "data: dropped 1 of 2 val prompts of data_source b longer than data.max_prompt_length=200 tokens "
        "(data.overlong_prompts=drop); val/b/* count the 1 that fit"]
    assert f"data: 2 val prompts from {path}; data_source a (1), b (1)" in caplog.text


def test_overlong_prompts_error_names_the_row(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"question": "Q", "answer": "1"}, {"question": "Q" * 500, "answer": "1"}]
    path = _write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(DataError, match=rf"^{path}:2: the prompt is \d+ tokens, longer than "
                                         r"data.max_prompt_length=200; .*data.overlong_prompts=drop"):
        load_prompts(_files_cfg(path, max_prompt_length=200, overlong_prompts="error"), tokenizer, "train")


def test_val_files_are_read_for_validation_whatever_data_source_says(tmp_path: Path, tokenizer: Any) -> None:
    """The defect: ppo-eval data.val_files=test.jsonl used to report on the arithmetic generator."""
    path = _write_jsonl(tmp_path / "test.jsonl", ROWS)
    cfg = DataConfig(source="arithmetic", val_files=[str(path)], arithmetic=ArithmeticConfig(train_size=20))
    assert [r.question for r in load_prompts(cfg, tokenizer, "val")] == [row["question"] for row in ROWS]
    assert {r.data_source for r in load_prompts(cfg, tokenizer, "train")} == {"arithmetic"}
    train_only = DataConfig(source="arithmetic", train_files=[str(path)])
    assert {r.data_source for r in load_prompts(train_only, tokenizer, "train")} == {"test"}
    assert {r.data_source for r in load_prompts(train_only, tokenizer, "val")} == {"arithmetic"}


def test_the_plan_names_what_each_split_reads() -> None:
    cfg = DataConfig(val_files=["test.parquet"])
    assert (describe_split(cfg, "train"), describe_split(cfg, "val")) == (
        "the arithmetic generator: 20000 problems of + - * /, 30% with two operations, numbers up to 20",
        "data.val_files test.parquet")
    hub = DataConfig(source="openai/gsm8k", train_files=["a.jsonl", "b.parquet"])
    assert describe_split(hub, "train") == "data.train_files a.jsonl, b.parquet"
    assert describe_split(hub, "val") == "openai/gsm8k[test] from the hub"
    assert describe_split(DataConfig(source="files", train_files=["a.jsonl"]), "val") == "data.val_files, which is empty"
