"""Config keys of a critic worth having (critic warm-up target, critic epochs, the value head's
fit) and the positive-example LM loss: combinations that cannot work are one-line ConfigErrors naming
the key (exit 2), the critic's optimizer horizon follows its epochs, and the dry run says what the
run will do."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.config.derived import batch_arithmetic, optimizer_steps
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.plan.dry_run import describe_plan


@pytest.mark.parametrize("overrides, key, says", [
    (["algorithm.critic_warmup_explained_var=0.5"], "algorithm.critic_warmup_explained_var",
     "algorithm.critic_warmup=0 runs none"),
    (["algorithm.critic_warmup=5", "algorithm.critic_warmup_explained_var=0"], "algorithm.critic_warmup_explained_var",
     "in (0, 1]"),
    (["critic.ppo_epochs=0"], "critic.ppo_epochs", ">= 1"),
    (["critic.value_head_init=zeros"], "critic.value_head_init", "loaded, regression"),
    (["algorithm.positive_lm_examples=group_best"], "algorithm.positive_lm_examples",
     "algorithm.positive_lm_loss_coef=0 adds no positive-example loss"),
    (["algorithm.positive_lm_loss_coef=0.1", "algorithm.positive_lm_examples=group_best", "sampler.n=1"],
     "algorithm.positive_lm_examples", "set sampler.n >= 2"),
    (["algorithm.positive_lm_loss_coef=-0.1"], "algorithm.positive_lm_loss_coef", ">= 0"),
])
def test_a_combination_that_cannot_work_is_one_line_naming_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert str(err.value).startswith(f"'{key}'") and says in str(err.value) and "\n" not in str(err.value)


def test_a_warmup_target_without_a_warmup_exits_2_naming_both_keys(tmp_path):
    code = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])"
    result = subprocess.run([sys.executable, "-c", code, "trainer.dry_run=true",
                             "algorithm.critic_warmup_explained_var=0.5"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "'algorithm.critic_warmup_explained_var'" in result.stderr and "algorithm.critic_warmup" in result.stderr


def test_the_critics_epochs_set_its_optimizer_steps_and_its_schedules_horizon():
    # 8 prompts of mini-batches of 2: 4 mini-batches per epoch, 10 steps
    base = ["data.train_batch_size=8", "algorithm.ppo_mini_batch_size=2", "algorithm.ppo_epochs=2",
            "trainer.total_steps=10"]
    cfg = compose(base)
    assert batch_arithmetic(cfg)["critic_optimizer_steps_per_ppo_step"] == 8
    assert (optimizer_steps(cfg, "actor"), optimizer_steps(cfg, "critic")) == (80, 80)
    cfg = compose([*base, "critic.ppo_epochs=3", "algorithm.critic_warmup=4"])
    assert batch_arithmetic(cfg)["optimizer_steps_per_ppo_step"] == 8  # the actor's
    assert batch_arithmetic(cfg)["critic_optimizer_steps_per_ppo_step"] == 12
    assert (optimizer_steps(cfg, "actor"), optimizer_steps(cfg, "critic")) == (8 * 6, 12 * 10)
    # a warm-up that may end after its first step: the actor's horizon assumes it does
    cfg = compose([*base, "algorithm.critic_warmup=4", "algorithm.critic_warmup_explained_var=0.5"])
    assert optimizer_steps(cfg, "actor") == 8 * 9


@pytest.mark.parametrize("overrides, line", [
    ([], "critic warm-up: none (the actor updates from step 1)"),
    (["algorithm.critic_warmup=3"], "critic warm-up: 3 steps (only the critic updates, on Monte Carlo returns)"),
    (["algorithm.critic_warmup=10", "algorithm.critic_warmup_explained_var=0.4"],
     "critic warm-up: up to 10 steps, ending once critic/vf_explained_var >= 0.4 (only the critic updates, on Monte "
     "Carlo returns)"),
    (["critic.ppo_epochs=3"], "3 epoch(s) per step, value head from zeros)"),
    (["critic.value_head_init=regression"],
     "value head from zeros, refitted by ridge regression on step 1's Monte Carlo returns)"),
    (["algorithm.positive_lm_loss_coef=0.1"],
     "positive-example LM loss: 0.1 x NLL of the responses with score >= reward.correct_score"),
    (["algorithm.positive_lm_loss_coef=0.1", "algorithm.positive_lm_examples=group_best", "sampler.n=4"],
     "positive-example LM loss: 0.1 x NLL of the responses with the best of each prompt's group"),
])
def test_the_dry_run_says_what_the_critic_options_will_do(overrides, line):
    assert line in describe_plan(compose(["model=tiny", *overrides]), [])
