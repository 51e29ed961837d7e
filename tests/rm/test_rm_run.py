"""ppo-train-rm end to end on the tiny model: the Done-when command, the folder it writes (loaded by
transformers and RewardModelEngine, scoring as during training), its metrics, exact resume, LoRA's
merged export, and bad input stopping with exit 2 before any model loads."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from ppo_trainer.cli import rm_main
from ppo_trainer.config import metric_names
from ppo_trainer.core.pairwise import score_statistics
from ppo_trainer.models.score_stats import read_score_stats
from ppo_trainer.rm.pairs import load_pairs
from ppo_trainer.rm.train import compose_rm
from ppo_trainer.tracking import read_jsonl


def arithmetic_rows(count: int, offset: int = 0) -> list[dict]:
    """Pairs a rule tells apart: the right sum preferred over a wrong one; two data_sources."""
    rows = []
    for i in range(offset, offset + count):
        a, b = i % 7, (3 * i) % 5
        rows.append({"prompt": f"{a}+{b}=?", "chosen": f"#### {a + b}", "rejected": f"#### {a + b + 1 + i % 3}",
                     "data_source": "even" if i % 2 == 0 else "odd"})
    return rows


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("pairs")
    train, val = folder / "train.jsonl", folder / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_rows(24)))
    val.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_rows(8, offset=100)))
    return train, val


def command(train: Path, val: Path, out: Path, *extra: str) -> list[str]:
    return ["model=tiny", f"data.train_files=[{train}]", f"data.val_files=[{val}]", "trainer.total_steps=4",
            f"trainer.output_dir={out}", "data.train_batch_size=4", *extra]


@pytest.fixture(scope="module")
def run(pairs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rm")
    rm_main(command(*pairs, out, "trainer.val_every=2"))
    return out


def test_the_done_when_command_prints_the_held_out_accuracy_and_the_ppo_command(pairs, tmp_path, capfd):
    train, _ = pairs
    rm_main(["model=tiny", f"data.train_files=[{train}]", f"data.val_files=[{train}]", "trainer.total_steps=4",
             f"trainer.output_dir={tmp_path}"])
    out = capfd.readouterr().out
    assert re.search(r"step 4/4 .*val_acc \d\.\d{3}", out)
    assert re.search(r"val/pairwise_accuracy \(held-out\): final \d\.\d{4} \(step 4\)", out)
    model = re.search(r"reward model: (\S+)", out).group(1)
    assert f"use it: ppo-train reward.fn=null reward.model.path={model} reward.model.normalize=true" in out
    assert Path(model).is_absolute() and (Path(model) / "config.json").is_file()
    assert (tmp_path / "scores.png").is_file() and (tmp_path / "plots.png").is_file()


def test_every_metric_it_logs_is_in_the_catalogue(run):
    logged = {k for record in read_jsonl(run / "metrics.jsonl") for k in record} - {"step"}
    fixed = {k for k in logged if not any(p.fullmatch(k) for p in metric_names.RM_PATTERNS)}
    assert fixed == set(metric_names.RM_METRICS)
    assert {"val/even/pairwise_accuracy", "val/odd/margin/mean"} <= logged  # two data_sources: per source too


def loaded_scores(folder: Path, pairs_file: Path) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(chosen, rejected) scores of the pairs of `pairs_file` by the folder as transformers loads it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = compose_rm([f"data.train_files=[{pairs_file}]"]).data
    records = load_pairs(cfg, tokenizer, "train")
    with torch.no_grad():
        score = [model(input_ids=torch.tensor([ids])).logits[0, 0].item()
                 for p in records for ids in (p.chosen_ids, p.rejected_ids)]
    return torch.tensor(score[0::2]), torch.tensor(score[1::2]), records


def test_the_saved_folder_loads_in_transformers_and_scores_as_in_training(run, pairs):
    train, val = pairs
    folder = run / "checkpoints" / "global_step_4" / "reward_model"
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    chosen, rejected, _ = loaded_scores(folder, val)
    step4 = read_jsonl(run / "metrics.jsonl")[-1]
    assert step4["step"] == 4
    assert chosen.mean().item() == pytest.approx(step4["val/chosen_score/mean"], abs=1e-5)
    assert rejected.mean().item() == pytest.approx(step4["val/rejected_score/mean"], abs=1e-5)
    c, r, _ = loaded_scores(folder, train)
    expected = score_statistics(torch.cat([c, r]))
    stats = read_score_stats(folder)
    assert stats["count"] == 48 and stats["mean"] == pytest.approx(expected["mean"], abs=1e-5)
    assert stats["std"] == pytest.approx(expected["std"], abs=1e-5)


def test_reward_model_engine_scores_the_folder_as_training_did(run, pairs):
    from ppo_trainer.engine.reward_model import RewardModelEngine

    _, val = pairs
    folder = run / "checkpoints" / "global_step_4" / "reward_model"
    chosen, _, _ = loaded_scores(folder, val)
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    engine = RewardModelEngine(folder, dtype="float32")
    scored = engine.score_texts([[{"role": "user", "content": r["prompt"]}] for r in rows], [r["chosen"] for r in rows])
    assert torch.allclose(scored, chosen, atol=1e-5)


def test_a_resumed_run_logs_what_the_uninterrupted_one_did(run, pairs, tmp_path):
    rm_main(command(*pairs, tmp_path, "trainer.val_every=2", "trainer.stop_after_steps=2"))
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step_2"
    rm_main(command(*pairs, tmp_path, "trainer.val_every=2"))

    def without_timing(folder: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith("timing_s/")} for r in read_jsonl(folder / "metrics.jsonl")]

    assert without_timing(tmp_path) == without_timing(run)


def test_a_lora_model_exports_merged_and_scores_as_in_training(pairs, tmp_path):
    train, val = pairs
    rm_main(command(train, val, tmp_path, "model.lora.rank=4", "model.lora.alpha=8", "model.optim.lr=1e-2"))
    folder = tmp_path / "checkpoints" / "global_step_4" / "reward_model"
    assert not (folder / "adapter_config.json").exists()
    chosen, _, _ = loaded_scores(folder, val)
    assert chosen.mean().item() == pytest.approx(read_jsonl(tmp_path / "metrics.jsonl")[-1]["val/chosen_score/mean"],
                                                 abs=1e-5)


@pytest.mark.parametrize("lora", [[], ["model.lora.rank=4", "model.lora.alpha=8"]], ids=["full", "lora"])
def test_bfloat16_compute_feeds_the_float32_score_head(pairs, tmp_path, lora):
    """The score head runs inside transformers' forward on the backbone's bf16 states: FSDP casts them."""
    train, val = pairs
    rm_main(command(train, val, tmp_path, "model.dtype=bfloat16", "trainer.total_steps=1", *lora))
    losses = [r["train/loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert len(losses) == 1 and math.isfinite(losses[0])


@pytest.mark.parametrize("change, message", [
    (lambda train, d: [f"data.train_files=[{d / 'missing.jsonl'}]"], "data.train_files: file not found"),
    (lambda train, d: ["data.chosen_key=better"], "missing key 'better'"),
    (lambda train, d: ["data.chosen_kye=better"], "chosen_kye"),
    (lambda train, d: [f"data.train_files=[{_bad_file(d)}]"], r"bad.jsonl:2: invalid JSON"),
    (lambda train, d: ["devices.backend=ray"], "ppo-train-rm trains in one process"),
])
def test_bad_data_or_keys_exit_2_before_any_model_loads(pairs, tmp_path, capfd, monkeypatch, change, message):
    from transformers import AutoModelForSequenceClassification

    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded")

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", refuse)
    train, val = pairs
    with pytest.raises(SystemExit) as stop:
        rm_main([*command(train, val, tmp_path / "out"), *change(train, tmp_path)])
    assert stop.value.code == 2
    err = capfd.readouterr().err
    assert re.search(message, err), err
    assert not (tmp_path / "out" / "checkpoints").exists()


def _bad_file(folder: Path) -> Path:
    path = folder / "bad.jsonl"
    path.write_text(json.dumps(arithmetic_rows(1)[0]) + "\n{not json\n")
    return path
