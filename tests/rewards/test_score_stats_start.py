"""PPO's running normalisation of a reward model's score starts from the score_stats.json that
ppo-train-rm writes; a resume whose reward model changed keeps the new model's start."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from ppo_trainer.models.score_stats import write_score_stats
from ppo_trainer.rewards.scoring import CombinedScorer, Part, RunningNorm, normalization_start
from ppo_trainer.run.resume import restored_reward_norm


def test_a_started_norm_standardises_by_the_saved_statistics_and_goes_on_from_them():
    norm = RunningNorm(True, None, {"mean": 2.0, "std": 0.5, "count": 1000})
    (value,) = norm([3.0])
    # Welford after one more score: mean 2 + 1/1001, m2 = 0.25 * 1000 + 1 * (3 - new mean)
    mean = 2.0 + 1 / 1001
    std = ((0.25 * 1000 + (3.0 - 2.0) * (3.0 - mean)) / 1001) ** 0.5
    assert value == pytest.approx((3.0 - mean) / (std + 1e-8), rel=1e-9)  # RunningNorm's epsilon
    assert norm.state_dict()["count"] == 1001


def test_the_start_is_read_from_a_normalised_reward_models_folder(tmp_path):
    write_score_stats(tmp_path, {"mean": -1.5, "std": 2.0, "count": 64})
    model = OmegaConf.create({"path": str(tmp_path), "normalize": True})
    assert normalization_start(model) == {"mean": -1.5, "std": 2.0, "count": 64}
    assert normalization_start(OmegaConf.create({"path": str(tmp_path), "normalize": False})) is None
    assert normalization_start(OmegaConf.create({"path": "random:tiny-reward", "normalize": True})) is None


def test_a_changed_reward_model_at_resume_keeps_the_new_models_start(tmp_path):
    state = {"step": 3, "reward_fingerprint": {"reward.model.path": "/old"},
             "reward_norm": {"model": {"count": 10, "mean": 9.0, "m2": 1.0}}}
    scorer = CombinedScorer(None, [Part("model", None, 1.0, RunningNorm(True, None, {"mean": 0.5, "std": 1.0,
                                                                                      "count": 40}))])
    scorer.load_state_dict(restored_reward_norm(tmp_path, state, {"reward.model.path": "/new"}))
    assert scorer.state_dict()["model"] == {"count": 40, "mean": 0.5, "m2": 40.0}
