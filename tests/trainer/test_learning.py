"""Learning from scratch (slow, not in CI): a tiny random model learns single-digit sums from a
sparse 0/1 reward, from chance (~0.02) to a mean score of at least 0.8.

    pytest -m slow tests/trainer/test_learning.py
"""

from __future__ import annotations

import json
import random

import pytest

from ppo_trainer.cli import compose
from ppo_trainer.trainer import run_training


@pytest.mark.slow
def test_tiny_model_learns_single_digit_sums_with_sparse_reward(tmp_path):
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    rows = [{"question": f"{a}+{b}", "answer": f"#### {a + b}"} for a, b in pairs]
    rng.shuffle(rows)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose([
        "model=tiny", "model.dtype=float32", "critic.dtype=float32",
        "model.optim.lr=3e-3", "critic.lr=3e-3",
        "data.source=files", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
        "data.use_chat_template=false", "data.prompt_template='{question}='", "data.instruction=''",
        "data.train_batch_size=32", "data.max_prompt_length=16",
        "sampler.n=8", "sampler.max_new_tokens=2",
        "reward.mode=flexible",  # the last number in the response, 0/1
        "gae.kl_coef=0", "gae.gamma=1", "gae.lam=1",
        "algorithm.ppo_mini_batch_size=16", "algorithm.ppo_epochs=2", "algorithm.ppo_micro_batch_tokens=4096",
        "trainer.total_steps=150", "trainer.val_every=25", "trainer.save_every=0",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.loggers=[jsonl]",
    ])
    run_training(cfg)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scores = [m["critic/score/mean"] for m in metrics if "critic/score/mean" in m]
    assert sum(scores[:5]) / 5 < 0.2, "starts near chance"
    assert sum(scores[-10:]) / 10 >= 0.8, f"learned: last scores {scores[-10:]}"
    assert metrics[-1]["val/accuracy"] >= 0.8
