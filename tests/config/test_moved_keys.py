"""Keys that moved (the critic's optimizer settings into critic.optim): an old key in a sweep file
stops the sweep naming its new place; a config saved with the old keys is read with them at their
new places, once and with one line, so an older run folder resumes without a spurious change and
ppo-eval evaluates it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ppo_trainer import cli
from ppo_trainer.config import overrides, schema
from ppo_trainer.config.composition import compose, load_saved
from ppo_trainer.config.schema import MOVED_KEYS

MOVED_LINE = "was saved with keys that have moved since; read at their new places: critic.lr -> critic.optim.lr"


def with_flat_critic_keys(path: Path) -> None:
    """Rewrite a saved config as a run from before critic.optim wrote it (critic.lr, critic.betas, ...)."""
    config = OmegaConf.load(path)
    for key, value in (config.critic.pop("optim", None) or {}).items():
        config.critic[key] = value
    OmegaConf.save(config, path)


def moved_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "have moved since" in r.getMessage()]


def test_a_sweep_file_with_a_flat_critic_key_exits_2_naming_its_new_place(tmp_path, monkeypatch, capsys):
    shutil.copytree(schema.CONFIG_DIR, tmp_path / "configs")
    (tmp_path / "configs" / "sweep" / "old_lr.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      critic.lr: 1.0e-5,3.0e-5\n")
    monkeypatch.setattr(schema, "CONFIG_DIR", tmp_path / "configs")
    monkeypatch.setattr(overrides, "CONFIG_DIR", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.train_main(["--multirun", "+experiment=smoke", "+sweep=old_lr", "trainer.dry_run=true"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "ppo-train: config error: configs/sweep/old_lr.yaml, hydra.sweeper.params: unknown config key 'critic.lr': "
        "'critic.lr' moved to 'critic.optim.lr' (verl's spelling, like the actor's model.optim); write "
        "critic.optim.lr=...")


def test_a_saved_config_reads_each_flat_critic_key_at_its_new_place_and_says_so_once(tmp_path, caplog):
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create({"model": {"path": "random:tiny"},
                                     "critic": {"path": None, "lr": 3e-5, "betas": [0.8, 0.9], "grad_clip": 0.5}}), path)
    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        first, second = load_saved(path), load_saved(path)
    # critic.lora, added since, at the full critic the run trained (schema.ADDED_KEYS)
    expected = {"path": None, "optim": {"lr": 3e-5, "betas": [0.8, 0.9], "grad_clip": 0.5},
                "lora": schema.ADDED_KEYS["critic.lora"]}
    assert expected["lora"]["rank"] == 0
    assert OmegaConf.to_container(first.critic) == OmegaConf.to_container(second.critic) == expected
    assert moved_lines(caplog) == [f"config: {path} was saved with keys that have moved since; read at their new "
                                   "places: critic.lr -> critic.optim.lr, critic.betas -> critic.optim.betas, "
                                   "critic.grad_clip -> critic.optim.grad_clip"]


def test_every_critic_optimizer_key_has_moved_under_critic_optim():
    assert MOVED_KEYS == {f"critic.{k}": f"critic.optim.{k}" for k in (
        "lr", "weight_decay", "betas", "eps", "warmup_steps", "schedule", "min_lr_ratio", "grad_clip")}


RUN = ["+experiment=smoke", "trainer.loggers=[jsonl]", "trainer.total_steps=3", "trainer.save_every=2",
       "eval.limit=4", "critic.optim.lr=2e-3"]


@pytest.fixture(scope="module")
def old_run(tmp_path_factory) -> Path:
    """A run stopped after step 2 whose config.yaml and checkpoint config name the flat critic keys."""
    from ppo_trainer.trainer import run_training

    out = tmp_path_factory.mktemp("old-run")
    run_training(compose([*RUN, f"trainer.output_dir={out}", "trainer.stop_after_steps=2"]))
    for saved in (out / "config.yaml", out / "checkpoints" / "global_step_2" / "state" / "config.yaml"):
        with_flat_critic_keys(saved)
        assert OmegaConf.load(saved).critic.lr == 2e-3
    return out


@pytest.fixture
def run_copy(old_run, tmp_path) -> Path:
    shutil.copytree(old_run, tmp_path / "run")
    return tmp_path / "run"


def test_an_old_run_folder_resumes_with_no_change_but_the_stop_and_one_line_for_the_moved_keys(run_copy, caplog):
    from ppo_trainer.trainer import run_training

    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        run_training(compose([*RUN, f"trainer.output_dir={run_copy}"]))
    changes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: changed")]
    assert changes == ["resume: changed since step 2: trainer.stop_after_steps 2 -> null"]
    state_config = run_copy / "checkpoints" / "global_step_2" / "state" / "config.yaml"
    assert [line.partition(" was saved")[0] for line in moved_lines(caplog)] == [f"config: {state_config}"]
    steps = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "critic/lr" in s] == [1, 2, 3]
    assert steps[-1]["critic/lr"] == pytest.approx(2e-3)
    assert OmegaConf.load(run_copy / "config.yaml").critic.optim.lr == 2e-3  # written anew in today's keys


def test_ppo_eval_of_an_old_run_folder_reads_it_with_the_moved_keys(run_copy, tmp_path, caplog):
    from ppo_trainer.cli import run_eval

    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        (result,) = run_eval([f"model.path={run_copy}", f"eval.output_file={tmp_path / 'eval.jsonl'}"])
    assert (result["step"], result["num_examples"]) == (2, 4)
    assert len(moved_lines(caplog)) == 1 and MOVED_LINE in moved_lines(caplog)[0]
