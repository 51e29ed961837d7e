"""End-to-end smoke runs of the PPO loop (local backend), checkpoints and exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.trainer import run_training

CONTRACT_METRICS = [
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
    "critic/values/mean", "critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var",
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_coef",
    "actor/reward_kl_penalty", "actor/grad_norm", "critic/grad_norm", "response_length/mean",
    "response_length/clip_ratio", "timing_s/gen", "timing_s/old_logprob", "timing_s/ref", "timing_s/values",
    "timing_s/adv", "timing_s/update_critic", "timing_s/update_actor", "timing_s/sync", "timing_s/step",
    "perf/throughput", "perf/max_memory_allocated_gb",
]


def read_metrics(output_dir: Path) -> dict[int, dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def smoke(output_dir: Path, *overrides: str):
    cfg = compose(["+experiment=smoke", f"trainer.output_dir={output_dir}", "trainer.loggers=[jsonl]", *overrides])
    return run_training(cfg)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    smoke(out, "trainer.total_steps=6", "trainer.save_every=3")
    return out


def test_smoke_run_writes_every_contract_metric_and_output(uninterrupted):
    metrics = read_metrics(uninterrupted)
    assert sorted(metrics) == [0, 1, 2, 3, 4, 5, 6]
    assert "val/accuracy" in metrics[0]
    for step in range(1, 7):
        missing = [k for k in CONTRACT_METRICS if k not in metrics[step]]
        assert not missing, f"step {step} lacks {missing}"
    assert "val/accuracy" in metrics[6], "the last step validates"
    assert (uninterrupted / "config.yaml").is_file()
    samples = [json.loads(line) for line in (uninterrupted / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == set(range(1, 7))
    assert {"prompt", "response", "ground_truth", "score"} <= set(samples[0])


def test_checkpoints_follow_the_layout_and_rotation(uninterrupted):
    checkpoints = uninterrupted / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step_6"
    # val_every=2: the first validation (step 2) is the best so far (the tiny model scores 0 at
    # every step and only an improvement moves `best`), so step 2 is saved and kept as well
    assert (checkpoints / "best").read_text().strip() == "global_step_2"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best", "commit_order", "global_step_2",
                                                             "global_step_3", "global_step_6", "latest"]
    step = checkpoints / "global_step_6"
    assert (step / "actor" / "config.json").is_file()
    assert not (step / "actor_merged").exists()  # only a LoRA actor gets a merged export
    assert (step / "critic" / "config.json").is_file()
    assert (step / "state" / "trainer.json").is_file()
    assert (step / "state" / "actor").is_dir() and (step / "state" / "critic").is_dir()
    assert (step / "state" / "config.yaml").is_file()
    assert sorted(p.name for p in (step / "manifest").iterdir()) == ["actor.0.json", "critic.0.json"]


def test_resume_after_stop_gives_the_same_metrics_as_an_uninterrupted_run(uninterrupted, tmp_path):
    smoke(tmp_path, "trainer.total_steps=6", "trainer.save_every=3", "trainer.stop_after_steps=3")
    assert sorted(read_metrics(tmp_path)) == [0, 1, 2, 3]
    smoke(tmp_path, "trainer.total_steps=6", "trainer.save_every=3")  # the same command resumes
    expected, resumed = read_metrics(uninterrupted), read_metrics(tmp_path)
    assert sorted(resumed) == [0, 1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        keys = {k for k in expected[step] if not k.startswith(("timing_s/", "perf/"))}
        assert keys == {k for k in resumed[step] if not k.startswith(("timing_s/", "perf/"))}
        for key in keys:
            assert resumed[step][key] == expected[step][key], f"step {step} {key}"


def test_with_an_entropy_bonus_the_update_entropy_has_its_own_name(tmp_path):
    """actor/entropy stays the sampling policy's (old-logprob pass); the update's is separate."""
    smoke(tmp_path, "trainer.total_steps=1", "trainer.save_every=0", "algorithm.entropy_coef=0.01")
    metrics = read_metrics(tmp_path)[1]
    assert metrics["actor/entropy"] > 0 and metrics["actor/update_entropy"] > 0
    assert metrics["actor/entropy"] != metrics["actor/update_entropy"]


def test_with_a_positive_example_loss_the_actor_imitates_the_steps_correct_responses(tmp_path):
    """VAPO's NLL term: logged where a response scored reward.correct_score, 0 where none did."""
    reward = tmp_path / "parity_reward.py"  # the tiny model's responses score 0 or 1 by their first character
    reward.write_text("def reward(response, ground_truth):\n    return float(ord(response[:1] or 'a') % 2 == 0)\n")
    smoke(tmp_path / "run", "trainer.total_steps=3", "trainer.save_every=0", f"reward.fn={reward}:reward",
          "algorithm.positive_lm_loss_coef=0.5")
    metrics = read_metrics(tmp_path / "run")
    for step in (1, 2, 3):
        correct = metrics[step]["critic/score/mean"] > 0
        assert (metrics[step]["actor/positive_lm_loss"] > 0) is correct, step
    assert any(metrics[step]["critic/score/mean"] > 0 for step in (1, 2, 3))


def test_packed_sequences_train_the_first_step_as_padded_rows_do(uninterrupted, tmp_path):
    """algorithm.pack_sequences: step 1 samples the same rollouts, so its losses and statistics equal
    the padded run's up to float32 rounding (on no more padding: the smoke's responses are alike)."""
    smoke(tmp_path, "trainer.total_steps=1", "trainer.save_every=0", "algorithm.pack_sequences=true")
    padded, packed = read_metrics(uninterrupted)[1], read_metrics(tmp_path)[1]
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "critic/vf_loss",
                "critic/values/mean", "critic/grad_norm", "critic/advantages/mean"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    assert packed["actor/padding_share"] <= padded["actor/padding_share"]
    assert packed["critic/padding_share"] <= padded["critic/padding_share"]
