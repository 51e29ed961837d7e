"""Config keys of rollout correction and the GAE lambdas: invalid combinations are one-line
ConfigErrors naming the key (exit 2), and the dry-run plan shows what the run will use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.config.schema import ConfigError


@pytest.mark.parametrize("overrides,key", [
    (["algorithm.rollout_correction=tis", "algorithm.recompute_old_logprobs=false"], "algorithm.rollout_correction"),
    (["algorithm.rollout_correction=mis", "algorithm.recompute_old_logprobs=false"], "algorithm.rollout_correction"),
    (["algorithm.rollout_correction=seq"], "algorithm.rollout_correction"),
    (["algorithm.rollout_correction_cap=0.9"], "algorithm.rollout_correction_cap"),
    (["algorithm.rollout_correction_low=1.5", "algorithm.rollout_correction_high=1.2"],
     "algorithm.rollout_correction_low"),
    (["algorithm.rollout_correction_low=0"], "algorithm.rollout_correction_low"),
    (["algorithm.rollout_correction_high=0.8"], "algorithm.rollout_correction_high"),
    (["gae.critic_lam=1.5"], "gae.critic_lam"),
    (["gae.lam_mode=linear"], "gae.lam_mode"),
    (["gae.adaptive_alpha=0"], "gae.adaptive_alpha"),
    (["gae.adaptive_alpha=-0.05"], "gae.adaptive_alpha"),
])
def test_invalid_combination_is_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert f"'{key}'" in str(err.value) and "\n" not in str(err.value)


def test_defaults_are_off_and_valid_settings_compose():
    cfg = compose([])
    assert (cfg.algorithm.rollout_correction, cfg.gae.critic_lam, cfg.gae.lam_mode) == ("none", None, "fixed")
    cfg = compose(["algorithm.rollout_correction=mis", "algorithm.rollout_correction_low=1",
                   "algorithm.rollout_correction_high=1", "algorithm.rollout_correction_cap=1",
                   "gae.critic_lam=0", "gae.lam_mode=adaptive"])
    assert cfg.algorithm.rollout_correction == "mis" and cfg.gae.critic_lam == 0


def run_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    code = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, "trainer.dry_run=true", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_rollout_correction_without_recompute_exits_2(tmp_path):
    result = run_cli("algorithm.rollout_correction=tis", "algorithm.recompute_old_logprobs=false", cwd=tmp_path)
    assert result.returncode == 2
    assert "algorithm.rollout_correction" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_dry_run_plan_shows_the_lambdas_and_the_correction(tmp_path):
    result = run_cli("gae.lam_mode=adaptive", "gae.critic_lam=0.95", "algorithm.critic_warmup=3",
                     "algorithm.rollout_correction=tis", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "policy advantages 1 - 1/(0.05 x length) per sequence, critic returns 0.95 (1.0 in the critic warm-up)" \
        in result.stdout
    assert "rollout correction: tis, weights capped at 2.0" in result.stdout
