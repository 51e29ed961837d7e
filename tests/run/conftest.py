"""Fixtures of the run-level tests: a reward that varies between samples, so that the critic and the
group filter have something to learn from or keep (the smoke experiment's reward is always 0)."""

from __future__ import annotations

import pytest

LENGTH_REWARD = "def reward(response, ground_truth):\n    return len(response) / 16\n"


@pytest.fixture(scope="module")
def reward_fn(tmp_path_factory) -> str:
    """The `reward.fn=` override of a reward file scoring a response by its length."""
    path = tmp_path_factory.mktemp("reward") / "length_reward.py"
    path.write_text(LENGTH_REWARD)
    return f"reward.fn={path}:reward"
