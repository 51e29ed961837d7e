"""A smoke run with a verl-style compute_score in a file, on two reward workers, with length
shaping: its extras are logged per step, training scores carry the penalties, validation counts
its "acc" and stays unshaped."""

from __future__ import annotations

import json

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.trainer import run_training

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Varies with the random model's text: acc for an even number of letters, the score by length."""
    letters = sum(c.isalpha() for c in solution_str)
    score = len(solution_str) / 16
    return {"score": score, "acc": letters % 2 == 0, "raw": score, "letters": letters, "source": data_source}
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verl-reward")
    (folder / "verl_reward.py").write_text(REWARD)
    out = folder / "run"
    run_training(compose(["+experiment=smoke", f"trainer.output_dir={out}", "trainer.loggers=[jsonl]",
                          "trainer.total_steps=2", "trainer.val_every=1", "trainer.save_every=0",
                          f"reward.fn={folder}/verl_reward.py:compute_score", "reward.num_workers=2",
                          "reward.timeout_s=30", "reward.on_error=zero", "reward.truncation_penalty=0.2",
                          "reward.overlong_buffer=4", "reward.overlong_penalty=0.5"]))
    return out


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_functions_numeric_extras_are_logged_each_step(run):
    for step in records(run)[1:]:
        assert {"reward/acc/mean", "reward/raw/mean", "reward/letters/mean"} <= step.keys()
        assert "reward/source/mean" not in step  # text extras are not metrics
        assert 0 <= step["reward/acc/mean"] <= 1
        assert (step["reward/errors"], step["reward/timeouts"]) == (0, 0)


def test_training_scores_are_the_functions_less_the_penalties(run):
    for step in records(run)[1:]:
        assert step["reward/truncation_penalty"] == pytest.approx(0.2 * step["response_length/clip_ratio"])
        assert 0 <= step["reward/overlong_penalty"] <= 0.5
        shaped = step["reward/raw/mean"] - step["reward/truncation_penalty"] - step["reward/overlong_penalty"]
        assert step["critic/score/mean"] == pytest.approx(shaped, abs=1e-6)


def test_validation_counts_acc_and_is_unshaped(run):
    for step in records(run):
        rows = [json.loads(line) for line in (run / "val_generations" / f"step_{step['step']}.jsonl").read_text().splitlines()]
        assert step["val/accuracy"] == pytest.approx(sum(r["extras"]["acc"] for r in rows) / len(rows))
        assert step["val/score/mean"] == pytest.approx(sum(r["extras"]["raw"] for r in rows) / len(rows))
        assert all(r["correct"] == r["extras"]["acc"] and r["extras"]["source"] == "arithmetic" for r in rows)
    assert any(r["truncated"] for r in rows)  # so an unshaped score is not the shaped one
