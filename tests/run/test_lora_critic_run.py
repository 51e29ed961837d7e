"""A run with a LoRA critic (critic.lora.rank > 0) on the smoke experiment: its checkpoints hold the
adapter and the value head (critic/) and the merged critic (critic_merged/), both in the manifest; a
resumed run equals the uninterrupted one; critic.path takes either to start a new run; bad settings
exit 2 naming the key before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.trainer import run_training

# the tiny model answers no problem: a reward of the response's length gives the critic returns to learn
SMOKE = ["+experiment=smoke", "trainer.loggers=[jsonl]", "data.arithmetic.val_size=2"]
LORA_CRITIC = [*SMOKE, "critic.lora.rank=4", "critic.lora.alpha=8", "trainer.total_steps=4", "trainer.save_every=2"]


def read_metrics(output_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, reward_fn) -> Path:
    out = tmp_path_factory.mktemp("lora_critic")
    run_training(compose([*LORA_CRITIC, reward_fn, f"trainer.output_dir={out}"]))
    return out


def test_a_checkpoint_holds_the_adapter_the_head_and_the_merged_critic(uninterrupted):
    step = uninterrupted / "checkpoints" / "global_step_4"
    assert sorted(p.name for p in (step / "critic").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "value_head.json", "value_head.safetensors"]
    assert json.loads((step / "critic_merged" / "config.json").read_text())["architectures"] == [
        "LlamaForTokenClassification"]
    listed = json.loads((step / "manifest" / "critic.0.json").read_text())["files"]
    assert {"critic/adapter_model.safetensors", "critic_merged/model.safetensors"} <= set(listed)
    assert not (step / "actor_merged").exists()  # the actor is trained in full


def test_a_resumed_run_equals_the_uninterrupted_one(uninterrupted, reward_fn, tmp_path, assert_resumed_like):
    run_training(compose([*LORA_CRITIC, reward_fn, f"trainer.output_dir={tmp_path}", "trainer.stop_after_steps=2"]))
    run_training(compose([*LORA_CRITIC, reward_fn, f"trainer.output_dir={tmp_path}"]))  # the same command resumes
    assert_resumed_like(uninterrupted, tmp_path, (3, 4))
    assert read_metrics(tmp_path)[4]["critic/values/mean"] != 0  # the critic learned: its resume is no trivial one


def test_the_adapter_folder_and_the_step_folder_start_a_new_critic_alike(uninterrupted, tmp_path):
    """critic.path=<global_step_N>/critic (the adapter on its base) and =<global_step_N> (critic_merged/):
    the same trained critic, whose first values are not a fresh head's zeros."""
    step = uninterrupted / "checkpoints" / "global_step_4"
    first_values = {}
    for name, path in (("adapter", step / "critic"), ("merged", step)):
        run_training(compose([*SMOKE, f"critic.path={path}", "trainer.total_steps=1",
                              f"trainer.output_dir={tmp_path / name}"]))
        first_values[name] = read_metrics(tmp_path / name)[1]["critic/values/mean"]
    assert first_values["adapter"] != 0
    assert first_values["merged"] == pytest.approx(first_values["adapter"], abs=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["critic.lora.rank=-1"], "'critic.lora.rank' must be >= 0"),
    (["critic.lora.rank=4", "critic.lora.target_modules=[]"],
     "'critic.lora.target_modules' must name at least one module with critic.lora.rank=4"),
    (["critic.lora.rank=4", "algorithm.adv_estimator=reinforce_plus_plus"],
     "'critic.lora.rank' is 4, but algorithm.adv_estimator=reinforce_plus_plus is critic-free"),
])
def test_bad_lora_critic_settings_exit_2_naming_the_key(no_model_loading, ppo_train_error, overrides, message):
    assert message in ppo_train_error(*overrides)


def test_an_actors_adapter_as_critic_path_exits_2_before_any_model_loads(no_model_loading, ppo_train_error,
                                                                          tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "x"}))
    line = ppo_train_error(f"critic.path={tmp_path / 'adapter'}")
    assert "critic.path=" in line and "a LoRA adapter without a value head" in line

