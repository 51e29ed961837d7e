"""algorithm.filter_groups (DAPO's dynamic sampling): off by default; what it cannot do is refused
(exit 2, one line naming the keys, before any model loads); its keys are refused on resume; the dry
run and the metric names show it."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ppo_trainer.config import metric_names
from ppo_trainer.config.composition import compose
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.plan.dry_run import algorithm_lines
from ppo_trainer.run.resume import REFUSED, check_config

FILTER = "algorithm.filter_groups=true"
METRICS = {"filter/kept_groups", "filter/draws", "filter/filled_groups"}


def message(line: str) -> str:
    return line.partition(": config error: ")[2]


def test_filtering_is_off_by_default():
    a = compose([]).algorithm
    assert (a.filter_groups, a.filter_groups_metric, a.filter_groups_max_draws) == (False, "score", 10)


@pytest.mark.usefixtures("no_model_loading")
def test_one_sample_per_prompt_exits_2_naming_both_keys(ppo_train_error):
    line = ppo_train_error(FILTER, "sampler.n=1")
    assert message(line).startswith("'algorithm.filter_groups' is true with sampler.n=1: a group of one sample")
    assert "set sampler.n >= 2, or algorithm.filter_groups=false" in line


@pytest.mark.usefixtures("no_model_loading")
def test_rollouts_generated_ahead_exit_2_naming_both_keys(ppo_train_error):
    line = ppo_train_error(FILTER, "devices.backend=ray", "algorithm.rollout_correction=tis", "sampler.max_staleness=1")
    assert message(line).startswith("'algorithm.filter_groups' is true with sampler.max_staleness=1")
    assert "set sampler.max_staleness=0, or algorithm.filter_groups=false" in line


@pytest.mark.usefixtures("no_model_loading")
@pytest.mark.parametrize("metric", ["seq_reward", "seq_final_reward", "accuracy"])
def test_a_metric_the_trainer_does_not_have_exits_2_naming_the_ones_it_has(ppo_train_error, metric):
    line = ppo_train_error(FILTER, f"algorithm.filter_groups_metric={metric}")
    assert message(line).startswith(f"'algorithm.filter_groups_metric' is '{metric}'; this trainer filters on score or acc")


@pytest.mark.usefixtures("no_model_loading")
def test_a_cap_below_one_draw_exits_2(ppo_train_error):
    assert "'algorithm.filter_groups_max_draws' must be >= 1" in ppo_train_error(FILTER, "algorithm.filter_groups_max_draws=0")


@pytest.mark.parametrize("metric", ["score", "acc"])
def test_filtering_composes_and_shows_in_the_dry_run(metric):
    cfg = compose(["+experiment=smoke", FILTER, f"algorithm.filter_groups_metric={metric}"])
    assert (f"dynamic sampling: groups whose {metric} is all equal are dropped and more prompts drawn, up to 10 "
            "draws a step (algorithm.filter_groups)") in algorithm_lines(cfg)
    assert not any(line.startswith("dynamic sampling") for line in algorithm_lines(compose(["+experiment=smoke"])))


def test_its_metrics_are_produced_only_when_on():
    assert METRICS <= metric_names.produced(compose(["+experiment=smoke", FILTER]), uses_reference=False)
    assert not METRICS & metric_names.produced(compose(["+experiment=smoke"]), uses_reference=False)


@pytest.mark.parametrize("key, saved_value", [("algorithm.filter_groups", True),
                                              ("algorithm.filter_groups_metric", "acc"),
                                              ("algorithm.filter_groups_max_draws", 3)])
def test_a_changed_filter_is_refused_on_resume(key, saved_value):
    """The batches drawn so far, and the loader's position, follow the filter: another continues another run."""
    assert key in REFUSED
    cfg = compose(["+experiment=smoke"])
    saved = OmegaConf.create(OmegaConf.to_container(cfg))
    OmegaConf.update(saved, key, saved_value)
    with pytest.raises(ConfigError, match=rf"refused: {key} "):
        check_config(Path("checkpoints/global_step_2"), saved, {"step": 2}, cfg)


@pytest.mark.usefixtures("no_model_loading")
@pytest.mark.parametrize("verl, here", [("algorithm.filter_groups.enable=true", "algorithm.filter_groups"),
                                        ("algorithm.filter_groups.metric=acc", "algorithm.filter_groups_metric"),
                                        ("algorithm.filter_groups.max_num_gen_batches=5",
                                         "algorithm.filter_groups_max_draws")])
def test_verls_nested_spelling_exits_2_naming_the_key_here(ppo_train_error, verl, here):
    key = verl.partition("=")[0]
    assert message(ppo_train_error(verl)) == f"unknown config key '{key}': verl's spelling; write {here}=..."
