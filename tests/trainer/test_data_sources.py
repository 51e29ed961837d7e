"""A run on data as users bring it: a verl-layout parquet and a plain GSM8K-style jsonl, mixed by
weight for training and validated per data_source with several samples per prompt; the record
fields reach samples.jsonl and the validation generations; a resumed run continues exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.config.schema import ArithmeticConfig, DataConfig
from ppo_trainer.data.arithmetic import generate_problems
from ppo_trainer.trainer import run_training

VERL_SOURCE = "arith/verl"  # a data_source with a slash: metric names keep it verbatim


def write_sources(folder: Path, split: str, size: int) -> list[str]:
    """Arithmetic problems of `split` as a verl-layout parquet (data_source arith/verl) and the
    next ones as a plain {question, answer} jsonl (data_source: its stem, plain_<split>)."""
    rows = generate_problems(ArithmeticConfig(train_size=2 * size, val_size=2 * size), split)
    instruction = DataConfig().instruction
    verl = [{"data_source": VERL_SOURCE, "prompt": [{"role": "user", "content": f"{row['question']} {instruction}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": row["answer"].rpartition("#### ")[2]},
             "extra_info": {"split": split, "index": i}} for i, row in enumerate(rows[:size])]
    parquet = folder / f"verl_{split}.parquet"
    pq.write_table(pa.Table.from_pylist(verl), parquet)
    plain = folder / f"plain_{split}.jsonl"
    plain.write_text("".join(json.dumps(row) + "\n" for row in rows[size:]))
    return [str(parquet), str(plain)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("data")
    train, val = write_sources(folder, "train", 24), write_sources(folder, "val", 3)
    return [f"data.train_files=[{','.join(train)}]", "data.train_weights=[3,1]", f"data.val_files=[{','.join(val)}]"]


def run(output_dir: Path, data: list[str], *overrides: str) -> None:
    run_training(compose(["+experiment=smoke", f"trainer.output_dir={output_dir}", "trainer.loggers=[jsonl]",
                          "trainer.total_steps=4", "trainer.log_samples=8", "eval.n=2", "eval.temperature=1.0",
                          *data, *overrides]))


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    run(out, data)
    return out


def test_validation_reports_each_source_with_mean_and_pass_at_n(uninterrupted):
    metrics = {r["step"]: r for r in lines(uninterrupted / "metrics.jsonl")}
    for source in (VERL_SOURCE, "plain_val"):
        for name in ("accuracy", "score/mean", "accuracy/mean@2", "accuracy/pass@2"):
            assert f"val/{source}/{name}" in metrics[0], (source, name)
    assert {"val/accuracy", "val/accuracy/mean@2", "val/accuracy/pass@2"} <= set(metrics[4])
    # the metrics are those of the saved generations: 2 samples of each of the 3 + 3 problems
    rows = lines(uninterrupted / "val_generations" / "step_4.jsonl")
    assert len(rows) == 12 and [r["sample"] for r in rows[:2]] == [0, 1]
    for source in (VERL_SOURCE, "plain_val"):
        mine = [r for r in rows if r["data_source"] == source]
        assert metrics[4][f"val/{source}/score/mean"] == pytest.approx(sum(r["score"] for r in mine) / 6)
    verl_row = next(r for r in rows if r["data_source"] == VERL_SOURCE)
    assert verl_row["extra_info"] == {"split": "val", "index": 0} and verl_row["ground_truth"].isdigit()
    assert sorted(p.name for p in (uninterrupted / "val_generations").iterdir()) == [
        "step_0.jsonl", "step_2.jsonl", "step_4.jsonl"]


def test_training_samples_carry_source_truth_and_extra_info_as_in_the_data(uninterrupted):
    samples = lines(uninterrupted / "samples.jsonl")
    by_source = {s["data_source"]: s for s in samples}
    assert set(by_source) == {VERL_SOURCE, "plain_train"}
    assert by_source["plain_train"]["ground_truth"].count("####") == 1  # the whole GSM8K-style answer
    assert by_source["plain_train"]["extra_info"] is None
    assert by_source[VERL_SOURCE]["extra_info"]["split"] == "train"


def test_a_resumed_run_mixes_and_validates_as_the_uninterrupted_one(uninterrupted, data, tmp_path):
    run(tmp_path, data, "trainer.stop_after_steps=2")
    run(tmp_path, data)  # the same command resumes from step 2
    assert lines(tmp_path / "samples.jsonl") == lines(uninterrupted / "samples.jsonl")
    assert lines(tmp_path / "val_generations" / "step_4.jsonl") == \
        lines(uninterrupted / "val_generations" / "step_4.jsonl")
    expected, resumed = (lines(out / "metrics.jsonl") for out in (uninterrupted, tmp_path))
    for old, new in zip(expected[3:], resumed[3:]):
        assert {k: v for k, v in new.items() if not k.startswith(("timing_s/", "perf/"))} == \
            {k: v for k, v in old.items() if not k.startswith(("timing_s/", "perf/"))}
