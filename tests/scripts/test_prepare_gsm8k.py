"""scripts/prepare_gsm8k.py: GSM8K jsonl -> verl-layout parquet that the trainer reads with its default keys."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.data import load_prompts
from ppo_trainer.models.loading import load_tokenizer

ROWS = [{"question": "A box holds 1,000 beads; 1 is lost. How many are left?", "answer": "1000 - 1 = 999\n#### 999"},
        {"question": "Tom earns $800 a week for 2 weeks. How much?", "answer": "800 * 2 = 1600\n#### 1,600"}]


def test_rows_are_written_in_verls_layout_with_the_recipes_instruction(tmp_path, capsys, load_script):
    source = tmp_path / "test.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    load_script("prepare_gsm8k").main([str(source), "--out", str(tmp_path / "out")])
    rows = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    instruction = compose(["+experiment=gsm8k"]).data.instruction
    assert rows[1] == {"data_source": "openai/gsm8k",
                       "prompt": [{"role": "user", "content": f"{ROWS[1]['question']} {instruction}"}],
                       "ability": "math", "reward_model": {"style": "rule", "ground_truth": "1600"},
                       "extra_info": {"split": "test", "index": 1, "answer": ROWS[1]["answer"],
                                      "question": ROWS[1]["question"]}}
    assert f"{source}: 2 rows -> {tmp_path / 'out' / 'test.parquet'}" in capsys.readouterr().out


def test_the_trainer_reads_the_prepared_file_with_its_default_keys(tmp_path, tiny_model_dir, load_script):
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    load_script("prepare_gsm8k").main([str(source), "--out", str(tmp_path)])
    cfg = compose([f"data.train_files={tmp_path / 'train.parquet'}"]).data
    records = load_prompts(cfg, load_tokenizer(tiny_model_dir), "train")
    assert [(r.data_source, r.ground_truth) for r in records] == [("openai/gsm8k", "999"), ("openai/gsm8k", "1600")]
    assert records[0].question.startswith(ROWS[0]["question"])  # the instruction is in the data's user turn
    assert records[0].prompt.count(cfg.instruction) == 1  # and is not added again


def test_a_malformed_line_stops_with_the_file_and_line(tmp_path, load_script):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"question": "Q?", "answer": "no marker ####"}) + "\n")
    with pytest.raises(SystemExit, match=rf"prepare_gsm8k: {source}:2: ground truth .* has nothing after '####'"):
        load_script("prepare_gsm8k").main([str(source), "--out", str(tmp_path)])


def test_the_real_gsm8k_test_split_converts(gsm8k_dir, tmp_path, load_script):
    load_script("prepare_gsm8k").main([str(gsm8k_dir / "test.jsonl"), "--out", str(tmp_path)])
    rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert len(rows) == 1319 and rows[0]["reward_model"]["ground_truth"] == "18"
