"""A resume does what the command line says: every change since the checkpoint is printed, the
optimizer values and the KL coefficient are applied, keys that would continue another run are
refused before any model loads (unless trainer.resume_allow names them)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ppo_trainer.config.composition import compose
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.engine.optim import lr_factor
from ppo_trainer.run import checkpoint, resume
from ppo_trainer.run import folder as run_folder
from ppo_trainer.run.checkpoint import CheckpointError
from ppo_trainer.trainer import Trainer, run_training

BASE = ["+experiment=smoke", "trainer.loggers=[jsonl]", "trainer.total_steps=6", "trainer.save_every=2",
        "model.optim.lr=1e-3", "critic.optim.lr=1e-3"]
# smoke: 4 prompts per step, mini-batches of 2 prompts, 2 epochs: 4 optimizer steps per PPO step
OPTIMIZER_STEPS_PER_PPO_STEP = 4


def no_model_loading(*_args, **_kwargs):
    raise AssertionError("a model was about to load: the resume must be refused before")


def metrics(output_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def saved_at_step_2(tmp_path_factory) -> Path:
    """A run stopped after step 2 (checkpoint global_step_2)."""
    out = tmp_path_factory.mktemp("base")
    run_training(compose([*BASE, f"trainer.output_dir={out}", "trainer.stop_after_steps=2"]))
    return out


@pytest.fixture
def run_copy(saved_at_step_2, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(saved_at_step_2, out)
    return out


def resume_run(out: Path, *overrides: str, steps: int = 3):
    return run_training(compose([*BASE, f"trainer.output_dir={out}", f"trainer.stop_after_steps={steps}", *overrides]))


def resume_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: changed")]


def test_a_changed_learning_rate_is_printed_and_applied(run_copy, caplog):
    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        resume_run(run_copy, "model.optim.lr=5e-4", "critic.optim.lr=2e-4")
    assert resume_lines(caplog) == ["resume: changed since step 2: critic.optim.lr 0.001 -> 0.0002",
                                    "resume: changed since step 2: model.optim.lr 0.001 -> 0.0005",
                                    "resume: changed since step 2: trainer.stop_after_steps 2 -> 3"]
    step3 = metrics(run_copy)[3]
    assert step3["actor/lr"] == pytest.approx(5e-4) and step3["critic/lr"] == pytest.approx(2e-4)


def test_a_changed_kl_coef_restarts_the_controller_from_it(run_copy):
    resume_run(run_copy, "gae.kl_coef=0.01")
    assert metrics(run_copy)[3]["actor/kl_coef"] == pytest.approx(0.01)


def test_an_unchanged_adaptive_controller_continues_from_its_saved_coefficient(tmp_path):
    adaptive = ["gae.kl_ctrl=adaptive", "gae.kl_target=0.0001", "gae.kl_horizon=10"]  # moves a lot each step
    run_training(compose([*BASE, *adaptive, f"trainer.output_dir={tmp_path}", "trainer.stop_after_steps=2"]))
    saved = json.loads((tmp_path / "checkpoints" / "global_step_2" / "state" / "trainer.json").read_text())
    resume_run(tmp_path, *adaptive)
    assert metrics(tmp_path)[3]["actor/kl_coef"] == pytest.approx(saved["kl_ctrl"]["value"])
    assert saved["kl_ctrl"]["value"] != pytest.approx(0.001)


def test_a_changed_warmup_reshapes_the_schedule_from_the_restored_step(run_copy):
    resume_run(run_copy, "model.optim.warmup_steps=100")
    done = 2 * OPTIMIZER_STEPS_PER_PPO_STEP  # optimizer steps before step 3
    expected = sum(1e-3 * lr_factor(done + i, 100, "constant", None, 0.0)
                   for i in range(OPTIMIZER_STEPS_PER_PPO_STEP)) / OPTIMIZER_STEPS_PER_PPO_STEP
    assert metrics(run_copy)[3]["actor/lr"] == pytest.approx(expected)


def test_a_changed_critic_schedule_and_floor_reshape_its_schedule_from_the_restored_step(run_copy):
    resume_run(run_copy, "critic.optim.schedule=cosine", "critic.optim.min_lr_ratio=0.5")
    done, total = 2 * OPTIMIZER_STEPS_PER_PPO_STEP, 6 * OPTIMIZER_STEPS_PER_PPO_STEP  # trainer.total_steps=6
    expected = sum(1e-3 * lr_factor(done + i, 0, "cosine", total, 0.5)
                   for i in range(OPTIMIZER_STEPS_PER_PPO_STEP)) / OPTIMIZER_STEPS_PER_PPO_STEP
    assert metrics(run_copy)[3]["critic/lr"] == pytest.approx(expected)


def test_the_restored_optimizers_take_the_configs_betas_eps_and_weight_decay(run_copy):
    cfg = compose([*BASE, f"trainer.output_dir={run_copy}", "model.optim.betas=[0.8,0.95]", "model.optim.eps=1e-6",
                   "model.optim.weight_decay=0.1", "critic.optim.weight_decay=0.05",
                   "critic.optim.betas=[0.7,0.9]", "critic.optim.eps=1e-5", "algorithm.clip_ratio_low=0.1", "algorithm.clip_ratio_high=0.3"])
    with run_folder.exclusive(run_folder.absolute_output_dir(cfg)):
        trainer = Trainer.from_config(cfg)
        try:
            actor, critic = (group.workers.worker.engine for group in (trainer.actor, trainer.critic))
            assert trainer.step == 2 and actor.scheduler.last_epoch == 2 * OPTIMIZER_STEPS_PER_PPO_STEP
            groups = actor.optimizer.param_groups
            assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in groups)
            assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.1]  # norms and biases decay-free
            assert sorted(g["weight_decay"] for g in critic.optimizer.param_groups) == [0.0, 0.05]
            assert all(g["betas"] == (0.7, 0.9) and g["eps"] == 1e-5 for g in critic.optimizer.param_groups)
            assert (actor.algorithm.clip_ratio_low, actor.algorithm.clip_ratio_high) == (0.1, 0.3)
        finally:
            trainer.close()


def test_keys_read_every_step_follow_the_command_line(run_copy, capsys):
    """entropy bonus, cadences, total_steps and loggers of the resumed invocation, not the checkpoint's."""
    resume_run(run_copy, "algorithm.entropy_coef=0.01", "trainer.val_every=3", "trainer.save_every=1",
               "trainer.total_steps=4", "trainer.loggers=[console,jsonl]", steps=4)
    after = metrics(run_copy)
    assert sorted(after) == [0, 1, 2, 3, 4]
    assert "actor/update_entropy" in after[3] and "actor/update_entropy" not in after[2]
    assert "val/accuracy" in after[3] and "val/accuracy" not in after[1]
    assert (run_copy / "checkpoints" / "global_step_3").is_dir()  # save_every=1 saved step 3
    out = capsys.readouterr().out
    assert "step 3/4" in out and "run finished: 4 of 4 steps" in out


@pytest.mark.parametrize("override, key", [
    ("data.train_batch_size=8", "data.train_batch_size 4 -> 8"),
    ("sampler.n=4", "sampler.n 2 -> 4"),
    ("trainer.seed=1", "trainer.seed 0 -> 1"),
    ("model.lora.rank=4", "model.lora.rank 0 -> 4"),
    ("critic.lora.rank=4", "critic.lora.rank 0 -> 4"),
    ("critic.lora.target_modules=[q_proj]", "critic.lora.target_modules"),
    ("algorithm.adv_estimator=grpo", "algorithm.adv_estimator gae -> grpo"),
    ("data.arithmetic.train_size=128", "data.arithmetic.train_size 256 -> 128"),
    ("model.path=embedded:smollm2-135m-instruct", "model.path random:tiny -> embedded:smollm2-135m-instruct"),
])
def test_a_refused_change_stops_before_any_model_loads(run_copy, monkeypatch, override, key):
    monkeypatch.setattr("ppo_trainer.workers.group.build_groups", no_model_loading)
    with pytest.raises(ConfigError, match=f"refused: {key}.*trainer.resume_allow=") as error:
        resume_run(run_copy, override)
    assert "\n" not in str(error.value) and "trainer.resume=never" in str(error.value)


def test_resume_allow_accepts_a_refused_change_knowingly(run_copy):
    resume_run(run_copy, "data.train_batch_size=8", "algorithm.ppo_mini_batch_size=4",
               "trainer.resume_allow=[data.train_batch_size]")
    assert sorted(metrics(run_copy)) == [0, 1, 2, 3]


def test_changed_training_prompts_are_refused_naming_the_key(run_copy, monkeypatch):
    """A filter that keeps other prompts (max_prompt_length) moves the saved data position onto other rows."""
    monkeypatch.setattr("ppo_trainer.workers.group.build_groups", no_model_loading)
    with pytest.raises(ConfigError, match=r"training prompts differ .*256 -> \d+ records.*data.max_prompt_length"):
        resume_run(run_copy, "data.max_prompt_length=176")


def test_validation_data_and_dtypes_as_configured_may_change(run_copy, caplog):
    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        resume_run(run_copy, "data.arithmetic.val_size=8", "model.dtype=auto")
    assert "resume: changed since step 2: data.arithmetic.val_size 16 -> 8" in resume_lines(caplog)
    assert "resume: changed since step 2: model.dtype float32 -> auto" in resume_lines(caplog)


def test_a_dtype_resolved_differently_here_is_printed(caplog):
    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        resume.check_dtypes({"step": 7, "dtypes": {"actor": "bfloat16"}}, {"actor": "float32"})
    assert caplog.messages == ["resume: the actor computes in float32 here, in bfloat16 when step 7 was saved "
                               "(dtype=auto on another device)"]


def test_a_checkpoint_from_before_critic_lora_resumes_with_no_change_of_it(run_copy):
    """Its saved config has no critic.lora: read as the full critic it trained (config.schema.ADDED_KEYS)."""
    saved = run_copy / "checkpoints" / "global_step_2" / "state" / "config.yaml"
    config = OmegaConf.load(saved)
    del config.critic["lora"]
    OmegaConf.save(config, saved)
    current = compose([*BASE, f"trainer.output_dir={run_copy}"])
    changes = resume.config_changes(checkpoint.saved_config(saved.parents[1]), current)
    assert [key for key, _, _ in changes if key.startswith("critic.lora")] == []


def test_a_checkpoint_without_its_config_is_refused_as_corrupt_naming_the_folder(run_copy):
    state = run_copy / "checkpoints" / "global_step_2" / "state"
    (state / "config.yaml").unlink()  # every commit holds it (checkpoint.DRIVER_FILES): this one was damaged
    with pytest.raises(CheckpointError, match=f"corrupt resume state in {state}: config.yaml cannot be read"):
        resume_run(run_copy)


def test_config_changes_compares_leaves_and_skips_the_folder_keys():
    old = OmegaConf.create({"a": {"b": 1, "c": [1, 2]}, "trainer": {"output_dir": "x", "resume": "auto"}})
    new = OmegaConf.create({"a": {"b": 1, "c": [1, 3], "d": None}, "trainer": {"output_dir": "y", "resume": "/p"}})
    changes = resume.config_changes(old, new)
    assert [(k, o, n) for k, o, n in changes if k == "a.c"] == [("a.c", [1, 2], [1, 3])]
    assert [k for k, _, _ in changes] == ["a.c", "a.d"]
