"""The lag schedule of asynchronous rollouts: which weight version a step trains on, and how stale
each sample (with partial rollouts: each token) is. Integers throughout: the schedule is exact, never
a float that could round."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.core.staleness import behaviour_step, sample_staleness, staleness_metrics, token_staleness_metrics


def test_no_lag_is_todays_loop_each_step_samples_with_the_weights_it_updates():
    assert [behaviour_step(step, 0) for step in range(1, 6)] == [0, 1, 2, 3, 4]
    assert all(staleness_metrics(step, torch.tensor([step - 1] * 4)) == {
        "rollout/staleness/mean": 0.0, "rollout/staleness/max": 0.0} for step in range(1, 6))


@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_lag_of_k_starts_on_the_initial_weights_then_trails_by_exactly_k(k):
    steps = range(1, 12)
    versions = [behaviour_step(step, k) for step in steps]
    assert versions[: k + 1] == [0] * (k + 1)  # the first k+1 steps train on the initial weights
    assert versions[k + 1:] == list(range(1, 11 - k))
    lags = [int(sample_staleness(step, torch.tensor([v]))) for step, v in zip(steps, versions)]
    assert lags == [min(step - 1, k) for step in steps]  # 0 at step 1, never above k


def test_the_metrics_are_the_mean_and_max_over_the_steps_samples():
    """Samples of several versions in one step (a pipeline that mixes them): lags 0, 1, 3, 2: mean 1.5, max 3."""
    assert staleness_metrics(5, torch.tensor([4, 3, 1, 2])) == {"rollout/staleness/mean": 1.5,
                                                                "rollout/staleness/max": 3.0}
    assert sample_staleness(5, torch.tensor([4, 3, 1, 2])).dtype == torch.long


def test_a_sample_from_the_future_or_a_step_before_the_first_is_refused():
    with pytest.raises(ValueError, match="weight version 3 cannot train at step 3: step 3 updates version 2"):
        sample_staleness(3, torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="step >= 1 and max_staleness >= 0, got 0 and 1"):
        behaviour_step(0, 1)
    with pytest.raises(ValueError, match="got 2 and -1"):
        behaviour_step(2, -1)


def test_with_partial_rollouts_the_metrics_are_over_the_response_tokens_of_each_version():
    """Step 5 updates version 4. Row 0: 2 tokens of version 3 then 1 of 4 (cut by a push); row 1: 2
    tokens of version 3 and padding (version 0, not counted); row 2: 1 token of version 2. Lags 1, 1, 0,
    1, 1, 2: mean 6/6 = 1, max 2; one sample of three spans two versions."""
    versions = torch.tensor([[3, 3, 4], [3, 3, 0], [2, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    assert token_staleness_metrics(5, versions, mask) == {"rollout/staleness/mean": 1.0, "rollout/staleness/max": 2.0,
                                                          "rollout/staleness/cut_share": 1 / 3}


def test_token_staleness_needs_a_response_token_and_no_version_from_the_future():
    with pytest.raises(ValueError, match="no response token"):
        token_staleness_metrics(2, torch.tensor([[1, 1]]), torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="weight version 3 cannot train at step 3"):
        token_staleness_metrics(3, torch.tensor([[2, 3]]), torch.tensor([[1, 1]]))
