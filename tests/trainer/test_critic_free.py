"""A critic-free run (algorithm.adv_estimator=grpo) end to end on the smoke experiment: it builds
no critic, logs no metric of one, saves no critic part, and resumes exactly."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from ppo_trainer.config import metric_names
from ppo_trainer.config.composition import compose
from ppo_trainer.trainer import run_training
from ppo_trainer.workers import group as worker_group

# The tiny model scores 0 on every sample; the entropy bonus moves the actor from step 1 on, so the KL
# penalty in the reward tells a prompt's samples apart and grpo's advantages are not all 0.
GRPO = ["+experiment=smoke", "trainer.loggers=[jsonl]", "algorithm.adv_estimator=grpo", "trainer.total_steps=4",
        "trainer.save_every=2", "algorithm.entropy_coef=0.01"]


def read_metrics(output_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, list[str]]:
    """The run's folder and the roles whose workers it built."""
    out = tmp_path_factory.mktemp("grpo")
    built: list[str] = []

    class RecordingWorker(worker_group.Worker):
        def __init__(self, role, *args, **kwargs):
            built.append(role)
            super().__init__(role, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker_group, "Worker", RecordingWorker)
        run_training(compose([*GRPO, f"trainer.output_dir={out}"]))
    return out, built


def test_a_critic_free_run_builds_no_critic(uninterrupted):
    assert uninterrupted[1] == ["actor", "rollout"]


def test_a_critic_free_run_logs_no_critic_metric_and_its_advantages(uninterrupted):
    metrics = read_metrics(uninterrupted[0])
    assert sorted(metrics) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        logged = set(metrics[step])
        assert logged & set(metric_names.CRITIC) == set(), step
        assert not any(k.startswith(("critic/values", "critic/vf_", "perf/critic/")) for k in logged), step
        assert {"critic/score/mean", "critic/advantages/mean", "critic/returns/mean", "actor/pg_loss",
                "timing_s/adv", "timing_s/update_actor"} <= logged, step
        # grpo's returns are its advantages, as verl logs them
        assert metrics[step]["critic/advantages/mean"] == metrics[step]["critic/returns/mean"]
    assert metrics[4]["actor/reward_kl_penalty"] != 0 and metrics[4]["actor/pg_loss"] != 0  # advantages not all 0


def test_a_critic_free_checkpoint_holds_no_critic_part(uninterrupted):
    step = uninterrupted[0] / "checkpoints" / "global_step_4"
    assert (step / "actor" / "config.json").is_file() and (step / "state" / "actor").is_dir()
    assert not (step / "critic").exists() and not (step / "state" / "critic").exists()
    assert sorted(p.name for p in (step / "manifest").iterdir()) == ["actor.0.json"]
    assert json.loads((step / "state" / "trainer.json").read_text())["dtypes"] == {"actor": "float32"}


def test_a_resumed_critic_free_run_equals_the_uninterrupted_one(uninterrupted, tmp_path, assert_resumed_like):
    run_training(compose([*GRPO, f"trainer.output_dir={tmp_path}", "trainer.stop_after_steps=2"]))
    assert sorted(read_metrics(tmp_path)) == [0, 1, 2]
    run_training(compose([*GRPO, f"trainer.output_dir={tmp_path}"]))  # the same command resumes
    assert_resumed_like(uninterrupted[0], tmp_path, (3, 4))


def test_a_critic_free_checkpoint_resumed_with_gae_where_resume_allow_says_so_starts_a_critic(uninterrupted, tmp_path,
                                                                                              caplog):
    shutil.copytree(uninterrupted[0], tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        run_training(compose([*GRPO, f"trainer.output_dir={tmp_path / 'run'}", "algorithm.adv_estimator=gae",
                              "trainer.total_steps=5", "trainer.resume_allow=[algorithm.adv_estimator]"]))
    assert any("was trained critic-free and holds no critic; the critic starts anew" in r.getMessage()
               for r in caplog.records)
    step = read_metrics(tmp_path / "run")[5]
    assert "critic/vf_loss" in step and "critic/vf_explained_var" in step
    assert (tmp_path / "run" / "checkpoints" / "global_step_5" / "state" / "critic").is_dir()
