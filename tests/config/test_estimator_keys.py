"""algorithm.adv_estimator and algorithm.norm_adv_by_std_in_grpo: their defaults, the cross-key rules
that refuse what a critic-free estimator cannot do (exit 2, one line naming the keys, before any
model loads), and the metrics a critic-free run logs."""

from __future__ import annotations

import pytest

from ppo_trainer.config import metric_names
from ppo_trainer.config.composition import compose
from ppo_trainer.config.derived import trained_roles, uses_critic, uses_reference
from ppo_trainer.config.schema import AlgorithmConfig, ConfigError


def test_gae_with_its_critic_is_the_default_and_grpo_scales_by_the_std_as_in_verl():
    assert (AlgorithmConfig.adv_estimator, AlgorithmConfig.norm_adv_by_std_in_grpo) == ("gae", True)
    cfg = compose([])
    assert uses_critic(cfg) and trained_roles(cfg) == ("actor", "critic")
    assert not uses_critic(compose(["algorithm.adv_estimator=rloo", "sampler.n=2"]))
    assert trained_roles(compose(["algorithm.adv_estimator=reinforce_plus_plus"])) == ("actor",)


@pytest.mark.usefixtures("no_model_loading")
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_group_estimator_with_one_sample_per_prompt_exits_2_naming_both_keys(ppo_train_error, estimator):
    line = ppo_train_error(f"algorithm.adv_estimator={estimator}", "sampler.n=1")
    assert "'sampler.n' is 1" in line and f"algorithm.adv_estimator={estimator}" in line and "sampler.n >= 2" in line


def test_reinforce_plus_plus_needs_no_group():
    assert compose(["algorithm.adv_estimator=reinforce_plus_plus", "sampler.n=1"]).sampler.n == 1


@pytest.mark.usefixtures("no_model_loading")
def test_a_critic_warmup_with_a_critic_free_estimator_exits_2_naming_both_keys(ppo_train_error):
    line = ppo_train_error("algorithm.adv_estimator=grpo", "algorithm.critic_warmup=2")
    assert "'algorithm.critic_warmup' is 2" in line and "algorithm.adv_estimator=grpo is critic-free" in line
    assert "set algorithm.critic_warmup=0" in line


@pytest.mark.usefixtures("no_model_loading")
def test_a_critic_path_with_a_critic_free_estimator_exits_2(ppo_train_error):
    line = ppo_train_error("algorithm.adv_estimator=rloo", "critic.path=random:tiny")
    assert "'critic.path' is set" in line and "algorithm.adv_estimator=rloo is critic-free and builds no critic" in line


@pytest.mark.usefixtures("no_model_loading")
def test_an_unknown_estimator_exits_2_listing_the_allowed_ones(ppo_train_error):
    line = ppo_train_error("algorithm.adv_estimator=ppo")
    assert "'algorithm.adv_estimator' is 'ppo'; allowed values: gae, grpo, rloo, reinforce_plus_plus" in line


def test_the_critics_devices_are_not_checked_when_no_critic_is_built():
    with pytest.raises(ConfigError, match=r"'devices.critic.num_devices' is 2, but devices.backend=local"):
        compose(["devices.critic.num_devices=2"])
    assert compose(["algorithm.adv_estimator=grpo", "sampler.n=2", "devices.critic.num_devices=2"])


def test_a_critic_free_run_logs_no_critic_metric_and_refuses_one_as_objective():
    cfg = compose(["+experiment=smoke", "algorithm.adv_estimator=grpo"])
    produced = metric_names.produced(cfg, uses_reference(cfg))
    assert produced & set(metric_names.CRITIC) == set()
    assert {"critic/score/mean", "critic/advantages/mean", "critic/returns/mean"} <= produced
    with pytest.raises(ConfigError, match="'trainer.objective' is 'critic/vf_explained_var', a metric this run never"):
        compose(["+experiment=smoke", "algorithm.adv_estimator=grpo", "trainer.objective=critic/vf_explained_var"])


def test_a_config_saved_before_the_estimator_existed_reads_as_gae_and_resumes_without_a_change(tmp_path):
    from omegaconf import OmegaConf

    from ppo_trainer.config.composition import load_saved
    from ppo_trainer.run.resume import config_changes

    cfg = compose(["+experiment=smoke"])
    older = OmegaConf.to_container(cfg)
    del older["algorithm"]["adv_estimator"]
    OmegaConf.save(OmegaConf.create(older), tmp_path / "config.yaml")
    saved = load_saved(tmp_path / "config.yaml")
    assert saved.algorithm.adv_estimator == "gae" and trained_roles(saved) == ("actor", "critic")
    assert config_changes(saved, cfg) == []
