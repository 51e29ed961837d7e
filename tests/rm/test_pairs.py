"""Preference data layouts (prompt + text, chat messages, HH-RLHF text, parquet), bad rows, identical
pairs and overlong pairs, tokenized exactly as RewardModelEngine renders a conversation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ppo_trainer.config.rm_schema import RMDataConfig
from ppo_trainer.data import DataError
from ppo_trainer.engine.reward_model import conversation_ids, plain_ids
from ppo_trainer.models.tiny import build_tiny_tokenizer
from ppo_trainer.rm.pairs import load_pairs

TOKENIZER = build_tiny_tokenizer()


def data_cfg(**keys):
    return OmegaConf.merge(OmegaConf.structured(RMDataConfig), keys)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_prompt_with_text_responses_is_the_user_turn_and_the_assistant_reply(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1?", "chosen": "2", "rejected": "3", "data_source": "sums"}])
    (pair,) = load_pairs(data_cfg(train_files=[str(f)]), TOKENIZER, "train")
    turns = [{"role": "user", "content": "1+1?"}]
    assert pair.chosen_ids == tuple(conversation_ids(TOKENIZER, turns, "2"))
    assert pair.rejected_ids == tuple(conversation_ids(TOKENIZER, turns, "3"))
    assert (pair.margin, pair.data_source, pair.where) == (0.0, "sums", f"{f}:1")


def test_conversational_sides_end_in_the_assistant_turn_with_or_without_a_prompt(tmp_path):
    user = {"role": "user", "content": "hi"}
    rows = [{"chosen": [user, {"role": "assistant", "content": "hello"}],
             "rejected": [user, {"role": "assistant", "content": "go away"}]},
            {"prompt": [user], "chosen": [{"role": "assistant", "content": "hello"}],
             "rejected": [{"role": "assistant", "content": "go away"}]}]
    without, with_prompt = (load_pairs(data_cfg(train_files=[str(write_jsonl(tmp_path / f"{i}.jsonl", [row]))]),
                                       TOKENIZER, "train")[0] for i, row in enumerate(rows))
    assert without.chosen_ids == with_prompt.chosen_ids == tuple(conversation_ids(TOKENIZER, [user], "hello"))
    assert without.rejected_ids == tuple(conversation_ids(TOKENIZER, [user], "go away"))


def test_hh_rlhf_text_holds_its_prompt_and_is_taken_as_it_is(tmp_path):
    chosen, rejected = "\n\nHuman: hi\n\nAssistant: hello", "\n\nHuman: hi\n\nAssistant: no"
    f = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": chosen, "rejected": rejected}])
    (pair,) = load_pairs(data_cfg(train_files=[str(f)]), TOKENIZER, "train")
    assert pair.chosen_ids == tuple(plain_ids(TOKENIZER, chosen)) and pair.data_source == "hh"


def test_parquet_rows_with_other_keys_and_a_margin(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "a?", "good": "yes", "bad": "no", "m": 0.5}]), path)
    cfg = data_cfg(train_files=[str(path)], prompt_key="q", chosen_key="good", rejected_key="bad", margin_key="m")
    (pair,) = load_pairs(cfg, TOKENIZER, "train")
    assert pair.margin == 0.5 and pair.where == f"{path} row 0"


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "'chosen' and 'rejected' are identical"),
    ({"prompt": "q", "chosen": "a"}, "missing key 'rejected'"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "'chosen' is an empty string"),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "x"}], "rejected": "b"}, "must end with the assistant"),
    ('{"prompt": "q", "chosen": ', "invalid JSON"),
])
def test_a_bad_row_is_an_error_naming_file_line_and_fault_or_skipped_with_bad_rows_skip(tmp_path, row, message):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    f = write_jsonl(tmp_path / "d.jsonl", [good, row])
    with pytest.raises(DataError, match=f"{f}:2: .*{message}.*data.bad_rows=skip"):
        load_pairs(data_cfg(train_files=[str(f)]), TOKENIZER, "train")
    assert len(load_pairs(data_cfg(train_files=[str(f)], bad_rows="skip"), TOKENIZER, "train")) == 1


def test_a_margin_that_is_not_a_number_is_a_bad_row(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}])
    with pytest.raises(DataError, match="'margin' \\(data.margin_key\\) must be a finite number"):
        load_pairs(data_cfg(train_files=[str(f)], margin_key="margin"), TOKENIZER, "train")


def test_overlong_pairs_are_dropped_or_an_error(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"},
                                            {"prompt": "q", "chosen": "x" * 100, "rejected": "b"}])
    assert len(load_pairs(data_cfg(train_files=[str(f)], max_length=50), TOKENIZER, "train")) == 1
    with pytest.raises(DataError, match=f"{f}:2: a side is .* longer than data.max_length=50"):
        load_pairs(data_cfg(train_files=[str(f)], max_length=50, overlong_pairs="error"), TOKENIZER, "train")


def test_missing_files_and_an_empty_split_name_the_key(tmp_path):
    with pytest.raises(DataError, match="data.train_files: file not found"):
        load_pairs(data_cfg(train_files=[str(tmp_path / "nope.jsonl")]), TOKENIZER, "train")
    with pytest.raises(DataError, match="data.val_files is empty"):
        load_pairs(data_cfg(), TOKENIZER, "val")
