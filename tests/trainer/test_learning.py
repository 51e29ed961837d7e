"""Learning from scratch (slow, not in CI): a tiny random model learns to answer a digit prompt
("7=") with that digit from a sparse 0/1 reward, from chance (~0.01 per sample over a 100-token
vocabulary) to a mean score of at least 0.8.

    pytest -m slow tests/trainer/test_learning.py

Measured (2 threads): the sampled mean score goes 0.06 (steps 1-10) -> 0.62 -> 0.95 -> 0.99
(steps 31-40), greedy validation accuracy 0.0 -> 1.0 at step 50; with the tests' one thread the
sampled score settles near 0.8 by step 100. Single-digit sums ("3+4=") with the same
settings plateau at a score of 0.2-0.3 within 200 steps: the policy settles on the most frequent
sums first.
"""

from __future__ import annotations

import json

import pytest

from ppo_trainer.config import compose
from ppo_trainer.trainer import run_training


@pytest.mark.slow
def test_tiny_model_learns_to_answer_with_the_prompted_digit_from_a_sparse_reward(tmp_path):
    rows = [{"question": str(d), "answer": f"#### {d}"} for d in range(10)] * 5
    data = tmp_path / "digits.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose([
        "model=tiny", "model.dtype=float32", "critic.dtype=float32",
        "model.optim.lr=3e-3", "critic.lr=3e-3",
        "data.source=files", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
        "data.use_chat_template=false", "data.prompt_template='{question}='", "data.instruction=''",
        "data.train_batch_size=32", "data.max_prompt_length=16",
        "sampler.n=8", "sampler.max_new_tokens=1",
        "reward.mode=flexible",  # 1 if the answer token is the right digit, else 0
        "gae.kl_coef=0", "gae.gamma=1", "gae.lam=1",
        "algorithm.ppo_mini_batch_size=16", "algorithm.ppo_epochs=2", "algorithm.ppo_micro_batch_tokens=4096",
        "trainer.total_steps=100", "trainer.val_every=25", "trainer.save_every=0",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.loggers=[jsonl]",
    ])
    run_training(cfg)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scores = [m["critic/score/mean"] for m in metrics if "critic/score/mean" in m]
    val = [m["val/score/mean"] for m in metrics if "val/score/mean" in m]
    assert sum(scores[:5]) / 5 < 0.2, "sampled responses start near chance"
    assert val[0] < 0.2, "greedy responses start near chance"
    assert val[-1] >= 0.8, f"greedy mean score after training: {val}"
    assert sum(scores[-10:]) / 10 >= 0.7, f"sampled (temperature 1) scores of the last steps: {scores[-10:]}"
