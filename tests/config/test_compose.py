"""Composition of every config group and experiment, overrides, and static validation errors."""

from __future__ import annotations

from typing import get_type_hints

import pytest
from omegaconf import OmegaConf

from ppo_trainer.config.composition import compose
from ppo_trainer.config.schema import CONFIG_DIR, ConfigError, PPOConfig, config_groups, group_options

GROUPS = [g for g in config_groups() if g not in ("experiment", "sweep")]  # the optional `+` groups


def test_the_groups_with_options_are_model_sampler_data_and_devices():
    assert GROUPS == ["data", "devices", "model", "sampler"]


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_group_option_composes(group, option):
    cfg = compose([f"{group}={option}"])
    assert cfg.trainer.total_steps >= 1


def _leaves(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        out.update(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_group_options_set_only_what_differs_from_the_schema(group, option):
    """The defaults live in the dataclasses of config.py; a group option restating one would drift."""
    values = _leaves(OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / f"{option}.yaml")) or {})
    schema = OmegaConf.structured(get_type_hints(PPOConfig)[group])
    assert {k: v for k, v in values.items() if OmegaConf.select(schema, k) == v} == {}


@pytest.mark.parametrize("experiment", group_options("experiment"))
def test_every_experiment_composes_and_names_its_output_dir(experiment):
    cfg = compose([f"+experiment={experiment}"])
    assert cfg.trainer.experiment_name == experiment
    assert cfg.trainer.output_dir == f"outputs/{experiment}"


def test_gsm8k_experiment_sets_the_published_recipe():
    cfg = compose(["+experiment=gsm8k"])
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.sampler.name == "vllm"
    assert (cfg.data.train_batch_size, cfg.algorithm.ppo_mini_batch_size) == (256, 64)
    assert (cfg.model.optim.lr, cfg.critic.optim.lr, cfg.gae.kl_coef) == (1e-6, 1e-5, 0.001)
    assert (cfg.gae.gamma, cfg.gae.lam, cfg.sampler.max_new_tokens) == (1.0, 1.0, 512)


def test_command_line_overrides_win_over_experiment_values():
    cfg = compose(["+experiment=gsm8k", "gae.lam=0.9", "sampler.n=4", "data.train_batch_size=128"])
    assert (cfg.gae.lam, cfg.sampler.n, cfg.data.train_batch_size) == (0.9, 4, 128)


def test_group_selection_on_the_command_line_overrides_the_experiment_choice():
    cfg = compose(["+experiment=gsm8k", "sampler=hf", "devices=cpu"])
    assert cfg.sampler.name == "hf"
    assert cfg.devices.accelerator == "cpu"


def test_single_file_path_is_accepted_for_list_keys():
    cfg = compose(["data.source=files", "data.train_files=train.jsonl", "data.val_files=test.jsonl"])
    assert list(cfg.data.train_files) == ["train.jsonl"]
    assert list(cfg.data.val_files) == ["test.jsonl"]


def test_data_source_files_needs_files_only_for_the_split_that_is_loaded():
    """ppo-eval reads only the validation split; training stops on the empty data.train_files when
    it loads the data, before any model (tests/test_cli_input_errors.py)."""
    assert list(compose(["data.source=files", "data.val_files=test.jsonl"]).data.train_files) == []


def test_files_for_one_split_leave_the_other_on_data_source():
    cfg = compose(["data.val_files=test.parquet"])
    assert cfg.data.source == "arithmetic" and list(cfg.data.val_files) == ["test.parquet"]
    mixed = compose(["data.train_files=[a.jsonl,b.parquet]", "data.train_weights=[3,1]"])
    assert list(mixed.data.train_weights) == [3.0, 1.0]


def test_chat_template_kwargs_take_new_keys_without_a_plus():
    assert compose(["data.chat_template_kwargs={enable_thinking:false}"]).data.chat_template_kwargs == \
        {"enable_thinking": False}
    cfg = compose(["data.chat_template_kwargs.enable_thinking=false", "+data.chat_template_kwargs.custom=x"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False, "custom": "x"}


def test_sampled_validation_needs_a_temperature_above_zero():
    with pytest.raises(ConfigError, match="'eval.n' is 4 with eval.temperature=0: greedy samples"):
        compose(["eval.n=4", "eval.temperature=0"])
    assert compose(["eval.n=4"]).eval.temperature is None  # the sampler's temperature


def test_mean_only_normalization_is_refused_when_normalization_is_off():
    with pytest.raises(ConfigError, match="'gae.advantage_std_scale' is false with gae.normalize_advantages=false"):
        compose(["gae.advantage_std_scale=false", "gae.normalize_advantages=false"])
    assert compose(["gae.advantage_std_scale=false"]).gae.normalize_advantages is True


def test_critic_path_defaults_to_none_meaning_the_actor_model():
    assert compose([]).critic.path is None


# (override, a fragment the one-line message must contain)
BAD_CONFIGS = [
    ("gae.gama=0.9", "gae.gama"),
    ("+gae.gama=0.9", "gae.gama"),
    ("+trainer.typo=1", "trainer.typo"),
    ("+nothing=1", "nothing"),
    ("sampler=nope", "sampler=nope"),
    ("+experiment=nope", "experiment=nope"),
    ("gae.lam=abc", "gae.lam"),
    ("sampler.n=two", "sampler.n"),
    ("gae.normalize_advantages=maybe", "gae.normalize_advantages"),
    ("model.optim.lr=0", "model.optim.lr"),
    ("critic.optim.lr=-1e-5", "critic.optim.lr"),
    ("sampler.n=0", "sampler.n"),
    ("algorithm.clip_ratio_low=1.5", "algorithm.clip_ratio_low"),
    ("algorithm.clip_ratio_high=0", "algorithm.clip_ratio_high"),
    ("algorithm.dual_clip=0.5", "algorithm.dual_clip"),
    ("gae.gamma=1.5", "gae.gamma"),
    ("gae.lam=-0.1", "gae.lam"),
    ("gae.kl_penalty=k9", "gae.kl_penalty"),
    ("algorithm.loss_agg_mode=mean", "algorithm.loss_agg_mode"),
    ("algorithm.ppo_mini_batch_size=3", "algorithm.ppo_mini_batch_size"),
    ("algorithm.ppo_micro_batch_tokens=16", "algorithm.ppo_micro_batch_tokens"),
    ("critic.lora.rank=-1", "critic.lora.rank"),
    ("+critic.lora.rank=8", "critic.lora"),
    ("devices.actor.num_devices=2", "devices.actor.num_devices"),
    ("sampler.vllm.gpu_memory_utilization=1.5", "sampler.vllm.gpu_memory_utilization"),
    ("data.train_files=[a.jsonl,a.jsonl]", "data.train_files"),
    ("data.train_weights=[1]", "data.train_weights"),
    ("data.overlong_prompts=truncate", "data.overlong_prompts"),
    ("data.source_key=''", "data.source_key"),
    ("eval.n=0", "eval.n"),
    ("eval.temperature=-1", "eval.temperature"),
    ("trainer.loggers=[console,bogus]", "trainer.loggers"),
    ("reward.fn=no_colon", "reward.fn"),
    ("model.dtype=float8", "model.dtype"),
    ("eval.limit=0", "eval.limit"),
]


@pytest.mark.parametrize("prefix", ["model.optim", "critic.optim"])
@pytest.mark.parametrize("setting", ["betas=[0.9,1.0]", "betas=[0.9]", "eps=0", "min_lr_ratio=1.5", "min_lr_ratio=-0.1"])
def test_the_actor_and_critic_optimizer_settings_are_checked_alike(prefix, setting):
    key = f"{prefix}.{setting.split('=')[0]}"
    with pytest.raises(ConfigError, match=f"^'{key}' must"):
        compose([f"{prefix}.{setting}"])


def test_the_critic_takes_the_actors_optimizer_settings_under_its_own_optim():
    cfg = compose(["critic.optim.betas=[0.8,0.95]", "critic.optim.eps=1e-6", "critic.optim.min_lr_ratio=0.1"]).critic
    assert (list(cfg.optim.betas), cfg.optim.eps, cfg.optim.min_lr_ratio) == ([0.8, 0.95], 1e-6, 0.1)


def test_the_critics_learning_rate_defaults_to_ten_times_the_actors():
    cfg = compose([])
    assert (cfg.model.optim.lr, cfg.critic.optim.lr) == (1e-6, 1e-5)


@pytest.mark.parametrize("override,fragment", BAD_CONFIGS)
def test_bad_config_is_one_line_naming_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        compose([override])
    message = str(err.value)
    assert fragment in message
    assert "\n" not in message


@pytest.mark.parametrize("section", ["critic", "gae", "algorithm", "reward", "eval", "trainer"])
def test_a_section_without_options_refuses_an_option_and_says_to_set_its_keys(section):
    with pytest.raises(ConfigError, match=rf"^unknown option '{section}=default'; '{section}' has no options .*set its "
                                          rf"keys instead, e.g. {section}\.\w+=\.\.\.$"):
        compose([f"{section}=default"])


def test_unknown_key_suggests_the_nearest_valid_key():
    with pytest.raises(ConfigError, match="did you mean 'gae.gamma'"):
        compose(["gae.gama=0.9"])


def test_ray_backend_allows_several_devices_per_role():
    cfg = compose(["devices=multi_gpu"])
    assert [cfg.devices[r].num_devices for r in ("actor", "critic", "rollout")] == [4, 4, 4]


def test_system_prompt_without_the_chat_template_is_rejected():
    with pytest.raises(ConfigError, match="'data.system_prompt' is set but data.use_chat_template=false"):
        compose(["data.system_prompt=Be brief.", "data.use_chat_template=false"])
    assert compose(["data.system_prompt=''"]).data.system_prompt == ""
