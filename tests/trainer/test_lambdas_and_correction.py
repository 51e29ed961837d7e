"""The driver's side of the lambda and rollout-correction options: one lambda per learner, the
lambda-1 critic warm-up, and rollout correction weights with their rollout_corr/* metrics in a real
(smoke) run."""

from __future__ import annotations

import json

import pytest
import torch

from ppo_trainer.batch import Batch
from ppo_trainer.config.composition import compose
from ppo_trainer.core import advantages as core_advantages
from ppo_trainer.core.critic_warmup import CriticWarmup
from ppo_trainer.core.gae import adaptive_lambda, compute_gae
from ppo_trainer.trainer import run_training


def gae_of(step: int, *overrides: str):
    """core.advantages.compute on a random ragged batch, with the config of `overrides`. Scores 0,
    old logprobs 0 and reference logprobs `rewards` under a k1 KL of coefficient 1 make the token
    rewards exactly `rewards`; returns the warm-up metrics only."""
    cfg = compose(["gae.normalize_advantages=false", "gae.kl_penalty=k1", *overrides])
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([30, 5, 17, 0, 60, 22])
    mask = (torch.arange(60) < lengths[:, None]).long()
    rewards = torch.randn(6, 60, generator=gen) * mask
    batch = Batch(input_ids=torch.zeros(6, 61, dtype=torch.long), attention_mask=torch.ones(6, 61),
                  position_ids=torch.zeros(6, 61), response_mask=mask, values=torch.randn(6, 60, generator=gen) * mask)
    warmup = CriticWarmup(cfg.algorithm.critic_warmup, None)  # no step observed: it lasts critic_warmup steps
    out = core_advantages.compute(torch.zeros(6), torch.zeros(6, 60), rewards, batch.values, mask, cfg.gae,
                                  cfg.algorithm, kl_coef=1.0, group_size=cfg.sampler.n,
                                  warming_up=warmup.active(step), warmup_phase=warmup.metric_phase(step))
    metrics = {k: v for k, v in out.metrics.items() if "warmup" in k}
    return cfg, rewards, batch, out.advantages, out.returns, metrics


def test_the_critic_learns_critic_lam_returns_and_the_policy_lam_advantages():
    _, rewards, batch, advantages, returns, metrics = gae_of(1, "gae.gamma=0.99", "gae.lam=0.9", "gae.critic_lam=0.5")
    torch.testing.assert_close(advantages, compute_gae(rewards, batch.values, batch.response_mask, 0.99, 0.9)[0])
    torch.testing.assert_close(returns, compute_gae(rewards, batch.values, batch.response_mask, 0.99, 0.5)[1])
    assert not torch.allclose(returns, compute_gae(rewards, batch.values, batch.response_mask, 0.99, 0.9)[1])
    assert metrics == {}


def test_critic_lam_defaults_to_lam():
    _, rewards, batch, advantages, returns, _ = gae_of(1, "gae.lam=0.8")
    expected = compute_gae(rewards, batch.values, batch.response_mask, 1.0, 0.8)
    torch.testing.assert_close(advantages, expected[0])
    torch.testing.assert_close(returns, expected[1])


def test_adaptive_lambda_sets_the_policy_advantages_and_the_critic_keeps_critic_lam():
    _, rewards, batch, advantages, returns, _ = gae_of(
        1, "gae.lam_mode=adaptive", "gae.adaptive_alpha=0.1", "gae.critic_lam=0.95")
    mask = batch.response_mask
    lams = adaptive_lambda(mask, 0.1)
    assert lams.tolist() == pytest.approx([1 - 1 / 3, 0.0, 1 - 1 / 1.7, 0.0, 1 - 1 / 6, 1 - 1 / 2.2])
    torch.testing.assert_close(advantages, compute_gae(rewards, batch.values, mask, 1.0, lams)[0])
    torch.testing.assert_close(returns, compute_gae(rewards, batch.values, mask, 1.0, 0.95)[1])


@pytest.mark.parametrize("step,critic_lam,metric", [(1, 1.0, "before"), (2, 1.0, None), (3, 0.5, "after"),
                                                    (4, 0.5, None)])
def test_critic_warmup_learns_monte_carlo_returns_and_reports_before_and_after(step, critic_lam, metric):
    _, rewards, batch, advantages, returns, metrics = gae_of(
        step, "algorithm.critic_warmup=2", "gae.lam=0.9", "gae.critic_lam=0.5")
    mask = batch.response_mask
    torch.testing.assert_close(returns, compute_gae(rewards, batch.values, mask, 1.0, critic_lam)[1])
    torch.testing.assert_close(advantages, compute_gae(rewards, batch.values, mask, 1.0, 0.9)[0])
    assert list(metrics) == ([f"critic/warmup_vf_explained_var_{metric}"] if metric else [])


def test_smoke_run_with_mis_decoupled_adaptive_lambda_and_warmup_reports_every_metric(tmp_path):
    cfg = compose(["+experiment=smoke", f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]",
                   "trainer.total_steps=2", "algorithm.critic_warmup=1", "algorithm.rollout_correction=mis",
                   "gae.critic_lam=0.95", "gae.lam_mode=adaptive"])
    run_training(cfg)
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2):
        for key in ("ess", "kl_k3", "masked_frac", "weight_mean", "weight_max"):
            assert f"rollout_corr/{key}" in rows[step], (step, key)
        assert 0 <= rows[step]["rollout_corr/ess"] <= 1
    assert "critic/warmup_vf_explained_var_before" in rows[1]
    assert "critic/warmup_vf_explained_var_after" in rows[2] and "actor/pg_loss" in rows[2]
