"""The metric catalogue (`metric_names`) against what runs log: trainer.objective is checked
against it before anything loads, so it must name exactly what a run writes."""

from __future__ import annotations

import json

import pytest

from ppo_trainer.config import metric_names
from ppo_trainer.config.composition import compose
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.config.derived import uses_reference
from ppo_trainer.trainer import run_training

VARIANTS = {
    "default": [],
    "every optional metric": ["algorithm.rollout_correction=tis", "algorithm.entropy_coef=0.01",
                              "algorithm.use_kl_loss=true", "algorithm.use_kl_in_reward=true", "algorithm.critic_warmup=1",
                              "reward.on_error=zero", "gae.kl_ctrl=adaptive", "trainer.total_steps=2",
                              "reward.num_workers=1", "reward.timeout_s=30", "reward.truncation_penalty=0.1",
                              "reward.overlong_buffer=4", "algorithm.positive_lm_loss_coef=0.1",
                              "critic.value_head_init=regression"],
    "no recompute, no reference": ["algorithm.recompute_old_logprobs=false", "gae.kl_coef=0", "trainer.total_steps=1"],
    "sampled validation": ["eval.n=2", "eval.temperature=1.0", "trainer.total_steps=1"],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_catalogue_names_exactly_what_a_smoke_run_logs(tmp_path, variant):
    cfg = compose(["+experiment=smoke", f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]",
                   "trainer.save_every=0", "trainer.total_steps=2", *VARIANTS[variant]])
    run_training(cfg)
    logged = {k for line in (tmp_path / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)} - {"step"}
    fixed = {k for k in logged if not any(p.fullmatch(k) for p in metric_names.PATTERNS)}
    assert fixed == metric_names.produced(cfg, uses_reference(cfg))


def test_an_objective_no_run_logs_is_a_config_error_naming_the_logged_ones():
    with pytest.raises(ConfigError, match=r"'trainer.objective' is 'val/acc', a metric this run never logs.*"
                                          r"val/accuracy or val/score/mean"):
        compose(["+experiment=smoke", "trainer.objective=val/acc"])
    with pytest.raises(ConfigError, match="actor/update_entropy"):
        compose(["+experiment=smoke", "trainer.objective=actor/update_entropy"])  # entropy_coef=0: never logged
    for fine in ("critic/vf_loss", "val/gsm8k/accuracy", "val/openai/gsm8k/accuracy/pass@4", "val/accuracy/mean@4",
                 "reward/format/mean"):
        assert compose(["+experiment=smoke", f"trainer.objective={fine}"]).trainer.objective == fine
