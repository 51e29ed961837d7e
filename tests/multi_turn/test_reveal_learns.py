"""Multi-turn learning from scratch (slow, not in CI): the tiny random model answers a digit its
prompt hides (`+experiment=digits_reveal`: "123?", data.digits.task=reveal). One turn finds it 1
time in 10; the environment (agents.tasks.RevealDigit, OpenRLHF's shape) answers a wrong first
guess with the digit, and the policy must learn to copy it in its second turn. Greedy success on
the held-out prompts must reach 0.8 within the experiment's 300 steps, with the critic's explained
variance logged, as PPO (the critic) and as GRPO (the critic-free baseline, reported beside it in
docs/learning.md#multi-turn; asserted to learn too).

    pytest -m slow tests/multi_turn/test_reveal_learns.py
"""

from __future__ import annotations

import json

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.trainer import run_training


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_the_tiny_model_learns_to_use_the_second_turn(tmp_path, estimator):
    run_training(compose(["+experiment=digits_reveal", f"algorithm.adv_estimator={estimator}",
                          f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]"]))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [m["val/accuracy"] for m in metrics if "val/accuracy" in m]
    assert val[0] <= 0.3, f"before training, greedy episodes solve about 1 in 10: {val[0]}"
    assert val[-1] >= 0.8, f"greedy success on the held-out prompts every 10 steps: {val}"
    turns = [m["num_turns/mean"] for m in metrics if "num_turns/mean" in m]
    assert max(turns) > 1.5, "most episodes needed the second turn"
    if estimator == "gae":
        assert all("critic/vf_explained_var" in m for m in metrics if "num_turns/mean" in m)
