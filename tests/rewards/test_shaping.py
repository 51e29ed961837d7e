"""Length shaping of training rewards against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.config.schema import RewardConfig
from ppo_trainer.rewards.shaping import overlong_penalty, penalties, truncation_penalty


def test_truncated_responses_lose_the_truncation_penalty():
    assert truncation_penalty(torch.tensor([True, False, True]), 0.5).tolist() == [0.5, 0.0, 0.5]


def test_dapo_overlong_penalty_rises_linearly_over_the_buffer():
    # max_new_tokens 16, buffer 4: free up to 12 tokens, then 1/4 of the factor per token over
    lengths = torch.tensor([3, 12, 13, 14, 16])
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == [0.0, 0.0, 0.25, 0.5, 1.0]
    assert overlong_penalty(lengths, 16, 4, 2.0).tolist() == [0.0, 0.0, 0.5, 1.0, 2.0]


def test_only_the_enabled_penalties_apply():
    truncated, lengths = torch.tensor([False, True]), torch.tensor([10, 16])
    assert penalties(truncated, lengths, 16, RewardConfig()) == {}
    both = penalties(truncated, lengths, 16, RewardConfig(truncation_penalty=0.3, overlong_buffer=8, overlong_penalty=0.5))
    assert both["truncation_penalty"].tolist() == pytest.approx([0.0, 0.3])
    assert both["overlong_penalty"].tolist() == pytest.approx([0.5 * 2 / 8, 0.5])
