"""The critic warm-up in a run (smoke model): algorithm.critic_warmup_explained_var ends it at the
step whose critic/vf_explained_var reaches the target, the actor updates from the next step on, and
a resume continues from the saved decision as the uninterrupted run does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.trainer import run_training

# The tiny random model's responses score 0 or 1 by their first character: returns vary from step 1.
REWARD = "def reward(response, ground_truth):\n    return float(ord(response[:1] or 'a') % 2 == 0)\n"
CAP, STEPS = 4, 5


def run(output_dir: Path, reward: Path, *overrides: str) -> dict[int, dict]:
    cfg = compose(["+experiment=smoke", f"trainer.output_dir={output_dir}", "trainer.loggers=[jsonl]",
                   f"reward.fn={reward}:reward", f"algorithm.critic_warmup={CAP}", f"trainer.total_steps={STEPS}",
                   "trainer.save_every=0", *overrides])
    run_training(cfg)
    return {r["step"]: r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())}


def trained(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the run warmed up for CAP steps, the first step of it whose explained variance is the highest
    before the cap, the run whose target is that value, the reward file)."""
    folder = tmp_path_factory.mktemp("warmup")
    reward = folder / "parity_reward.py"
    reward.write_text(REWARD)
    capped = run(folder / "capped", reward)
    explained = [capped[s]["critic/vf_explained_var"] for s in range(1, CAP)]
    stop = 1 + explained.index(max(explained))
    assert explained[stop - 1] > 0, f"no positive explained variance to stop on: {explained}"
    early = run(folder / "early", reward, f"algorithm.critic_warmup_explained_var={explained[stop - 1]!r}")
    return capped, stop, early, reward


def test_without_a_target_the_actor_waits_for_the_cap(runs):
    capped, _, _, _ = runs
    assert [s for s in range(1, STEPS + 1) if "actor/pg_loss" in capped[s]] == [CAP + 1]
    assert "critic/warmup_vf_explained_var_after" in capped[CAP + 1]


def test_the_warmup_ends_at_the_step_whose_explained_variance_reaches_the_target(runs):
    capped, stop, early, _ = runs
    assert stop < CAP
    assert [s for s in range(1, STEPS + 1) if "actor/pg_loss" in early[s]] == list(range(stop + 1, STEPS + 1))
    assert [s for s in early if "critic/warmup_vf_explained_var_after" in early[s]] == [stop + 1]
    assert "critic/warmup_vf_explained_var_before" in early[1]
    for step in range(1, stop + 1):  # the target changes nothing before the warm-up ends
        assert trained(early[step]) == trained(capped[step])


def test_a_resume_after_the_deciding_step_continues_as_the_uninterrupted_run(runs, tmp_path):
    _, stop, early, reward = runs
    target = f"algorithm.critic_warmup_explained_var={early[stop]['critic/vf_explained_var']!r}"
    run(tmp_path, reward, target, f"trainer.stop_after_steps={stop}")
    resumed = run(tmp_path, reward, target)
    for step in range(stop + 1, STEPS + 1):
        assert trained(resumed[step]) == trained(early[step]), step


def test_the_fitted_value_heads_in_sample_explained_variance_does_not_end_the_warmup(runs, tmp_path):
    """critic.value_head_init=regression fits step 1's values to step 1's own returns: the warm-up
    decides there on the fit's cross-validated figure, not on the in-sample one step 1 logs."""
    *_, reward = runs
    capped = run(tmp_path / "capped", reward, "critic.value_head_init=regression")
    in_sample, held_out = capped[1]["critic/vf_explained_var"], capped[1]["critic/value_head_fit/cv_explained_var"]
    assert in_sample > held_out, (in_sample, held_out)
    target = run(tmp_path / "target", reward, "critic.value_head_init=regression",
                 f"algorithm.critic_warmup_explained_var={in_sample!r}")
    assert "actor/pg_loss" not in target[2], "step 1's in-sample fit ended the warm-up"
