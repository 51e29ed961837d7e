"""The paths a run saves absolute (`config.paths.absolute_paths`) and the code keys the summary's
ppo-eval command names (`config.trust.code_overrides`): one list of code keys for both and for the
trust rule of ppo-eval."""

from __future__ import annotations

import shlex

import pytest

from ppo_trainer.config import trust
from ppo_trainer.config.composition import compose
from ppo_trainer.config.paths import absolute_paths
from ppo_trainer.config.secrets import mask_argument


def test_data_files_reward_files_and_local_model_folders_become_absolute_against_the_working_folder(tmp_path,
                                                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "critic").mkdir(parents=True)
    cfg = absolute_paths(compose(["data.train_files=[data/a.jsonl,/srv/b.parquet]", "data.val_files=[v.jsonl]",
                                  "reward.fn=rewards/gsm8k.py:compute_score", "eval.reward_fn=judge.py:score",
                                  "critic.path=models/critic", "reward.model.path=models/absent"]))
    assert list(cfg.data.train_files) == [str(tmp_path / "data" / "a.jsonl"), "/srv/b.parquet"]
    assert list(cfg.data.val_files) == [str(tmp_path / "v.jsonl")]
    assert cfg.reward.fn == f"{tmp_path / 'rewards' / 'gsm8k.py'}:compute_score"
    assert cfg.eval.reward_fn == f"{tmp_path / 'judge.py'}:score"
    assert cfg.critic.path == str(tmp_path / "models" / "critic")
    assert cfg.reward.model.path == "models/absent"  # no such folder here: a hub name, left as typed


@pytest.mark.parametrize("path", ["embedded:smollm2-135m-instruct", "random:tiny", "Qwen/Qwen2.5-0.5B-Instruct"])
def test_model_names_that_are_no_folder_here_and_module_references_stay_as_typed(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(compose([f"model.path={path}", "reward.fn=my_rewards.gsm8k:compute_score"]))
    assert (cfg.model.path, cfg.reward.fn) == (path, "my_rewards.gsm8k:compute_score")


def test_making_paths_absolute_twice_changes_nothing_more(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    once = absolute_paths(compose(["data.val_files=[v.jsonl]", "reward.fn=r.py:f"]))
    monkeypatch.chdir("/")
    twice = absolute_paths(once)
    assert (list(twice.data.val_files), twice.reward.fn) == ([str(tmp_path / "v.jsonl")], f"{tmp_path / 'r.py'}:f")


def test_the_summarys_ppo_eval_names_each_code_key_that_is_not_built_in():
    cfg = compose(["reward.fn=/runs/a/rewards.py:compute_score", "eval.reward_fn=ppo_trainer.rewards.math:score"])
    assert trust.code_overrides(cfg) == ["reward.fn=/runs/a/rewards.py:compute_score"]
    assert trust.code_overrides(compose(["reward.fn=my_pkg.rewards:score", "eval.reward_fn=judge.py:f"])) == [
        "reward.fn=my_pkg.rewards:score", "eval.reward_fn=judge.py:f"]
    assert trust.code_overrides(compose([])) == []  # the built-in math reward needs no trust


def test_a_code_path_hydra_would_not_read_unquoted_comes_in_hydras_quotes_and_parses_back():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = compose(["reward.fn='/my runs/it\\'s/r.py:f'"])
    (override,) = trust.code_overrides(cfg)
    assert override == "reward.fn='/my runs/it\\'s/r.py:f'"
    assert OverridesParser.create().parse_override(shlex.split(shlex.quote(override))[0]).value() == \
        "/my runs/it's/r.py:f"


def test_every_code_key_is_one_the_trust_rule_and_the_saved_paths_read():
    from ppo_trainer.config import paths

    assert trust.CODE_KEYS == ("reward.fn", "eval.reward_fn", "sampler.multi_turn.env", "sampler.multi_turn.tools")
    assert paths.CODE_KEYS is trust.CODE_KEYS


def test_an_environment_and_tools_are_code_keys_made_absolute_and_named_for_ppo_eval_built_ins_aside(tmp_path,
                                                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(compose(["sampler.multi_turn.env=envs/guess.py:Game",
                                  "sampler.multi_turn.tools=[calculator,my_tools.py:lookup,pkg.tools:search]"]))
    assert cfg.sampler.multi_turn.env == f"{tmp_path / 'envs' / 'guess.py'}:Game"
    assert list(cfg.sampler.multi_turn.tools) == ["calculator", f"{tmp_path / 'my_tools.py'}:lookup", "pkg.tools:search"]
    assert trust.code_overrides(cfg) == [f"sampler.multi_turn.env={tmp_path / 'envs' / 'guess.py'}:Game",
                                         f"sampler.multi_turn.tools=[calculator,{tmp_path / 'my_tools.py'}:lookup,"
                                         "pkg.tools:search]"]
    built_in = compose(["sampler.multi_turn.env=ppo_trainer.agents.tasks:RevealDigit",
                        "sampler.multi_turn.tools=[calculator,python]"])
    assert trust.code_overrides(built_in) == []


@pytest.mark.parametrize("arg, recorded", [
    ("reward.remote.token=abc", "reward.remote.token=***"), ("+trainer.wandb_api_key=k", "+trainer.wandb_api_key=***"),
    ("reward.remote.url=http://u:p@host/x", "reward.remote.url=http://***@host/x"),
    ("sampler.max_new_tokens=64", "sampler.max_new_tokens=64"), ("--multirun", "--multirun"),
])
def test_a_recorded_command_line_masks_secret_looking_values(arg, recorded):
    assert mask_argument(arg) == recorded
