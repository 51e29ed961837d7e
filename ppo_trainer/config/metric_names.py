"""The metrics a run logs (metrics.jsonl and the trackers), as its config decides them: the names
`trainer.objective` may take. tests/config/test_metric_names.py holds them to a smoke run's records."""

from __future__ import annotations

import re
from typing import Any, Optional

from ppo_trainer.config.derived import is_multi_turn, uses_critic

ALWAYS = (
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
    "actor/reward_kl_penalty", "actor/kl_coef", "actor/pg_loss", "actor/pg_clipfrac",
    "actor/ppo_kl", "actor/grad_norm", "actor/lr", "actor/skipped_steps", "actor/padding_share", "response_length/mean",
    "response_length/clip_ratio", "timing_s/gen", "timing_s/reward", "timing_s/old_logprob",
    "timing_s/adv", "timing_s/update_actor", "timing_s/sync", "timing_s/step",
    "perf/throughput", "perf/max_memory_allocated_gb", "perf/actor/max_memory_allocated_gb",
    "perf/rollout/max_memory_allocated_gb", "perf/sync_bytes", "perf/actor/idle_share", "perf/rollout/idle_share",
    "rollout/staleness/mean", "rollout/staleness/max", "val/accuracy", "val/score/mean",
)
# The critic's (algorithm.adv_estimator=gae): a critic-free run logs none of them.
CRITIC = (
    "critic/values/mean", "critic/vf_explained_var", "critic/vf_error/early", "critic/vf_error/middle",
    "critic/vf_error/late", "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr",
    "critic/skipped_steps", "critic/padding_share", "timing_s/values", "timing_s/update_critic", "perf/critic/max_memory_allocated_gb",
    "perf/critic/idle_share",
)
# Multi-turn rollouts' (an environment or tools: docs/multi-turn.md), verl's names where it has them.
MULTI_TURN = (
    "num_turns/mean", "num_turns/max", "num_turns/min", "multi_turn/tool_calls/mean", "multi_turn/tool_errors",
    "multi_turn/tool_timeouts", "multi_turn/observation_tokens/mean",
)
# Names that depend on the data, the reward or the environment: validation per data_source, a reward's
# named extras, the share of episodes per end reason, an environment's extra_logs.
PATTERNS = (re.compile(r"val/.+/(accuracy|score/mean)"), re.compile(r"val/(.+/)?accuracy/(mean|pass)@\d+"),
            re.compile(r"reward/([^/]+|remote/[^/]+)/mean"), re.compile(r"multi_turn/(end|env)/[^/]+"))

# ppo-train-rm's (every run logs them all; per data_source where the held-out pairs have several).
RM_METRICS = (
    "train/loss", "train/pairwise_accuracy", "train/margin/mean", "train/grad_norm", "train/lr", "train/skipped_steps",
    "timing_s/step", "val/pairwise_accuracy", "val/margin/mean", "val/loss", "val/chosen_score/mean",
    "val/rejected_score/mean", "val/score/std",
)
RM_PATTERNS = (re.compile(r"val/.+/(pairwise_accuracy|margin/mean)"),)


def produced(cfg: Any, uses_reference: bool) -> set[str]:
    """Every fixed metric name a run of `cfg` logs at some step (`uses_reference`: the config's
    reference policy is built, `derived_settings.uses_reference`)."""
    a = cfg.algorithm
    names = set(ALWAYS) | (set(CRITIC) if uses_critic(cfg) else set())
    if uses_reference:
        names.add("timing_s/ref")
    if a.recompute_old_logprobs:
        names |= {"actor/entropy", "rollout/logprob_diff_max", "rollout/logprob_diff_mean", "rollout_corr/kl_k3"}
    if a.rollout_correction != "none":
        cut = "truncated_frac" if a.rollout_correction == "tis" else "masked_frac"
        names |= {f"rollout_corr/{k}" for k in ("weight_mean", "weight_max", "ess", cut)}
    if a.entropy_coef > 0:
        names.add("actor/update_entropy")
    if a.use_kl_loss:
        names.add("actor/kl_loss")
    if a.critic_warmup:
        names |= {"critic/warmup_vf_explained_var_before", "critic/warmup_vf_explained_var_after"}
    if a.positive_lm_loss_coef > 0:
        names.add("actor/positive_lm_loss")
    if uses_critic(cfg) and cfg.critic.value_head_init == "regression":
        names |= {"critic/value_head_fit/ridge", "critic/value_head_fit/cv_explained_var"}
    r = cfg.reward
    if r.on_error == "zero":
        names.add("reward/errors")
        if r.timeout_s is not None or r.remote.url:
            names.add("reward/timeouts")
    if r.truncation_penalty > 0:
        names.add("reward/truncation_penalty")
    if r.overlong_buffer > 0:
        names.add("reward/overlong_penalty")
    if cfg.reward.model.path:
        names |= {"reward/model/std", "perf/reward_model/max_memory_allocated_gb", "perf/reward_model/idle_share"}
    if cfg.gae.kl_ctrl == "adaptive":
        names.add("kl_ctrl/skipped_updates")
    if is_multi_turn(cfg.sampler):
        names |= set(MULTI_TURN)
    if cfg.sampler.partial_rollouts:
        names.add("rollout/staleness/cut_share")
    if a.filter_groups:
        names |= {"filter/kept_groups", "filter/draws", "filter/filled_groups", "timing_s/filter"}
    return names


def objective_problem(cfg: Any, uses_reference: bool) -> Optional[str]:
    """Why `trainer.objective` names no metric this run logs (checkpoints/best would never be
    written, sweepers would get nothing), or None."""
    objective = cfg.trainer.objective
    names = produced(cfg, uses_reference)
    if objective in names or any(p.fullmatch(objective) for p in PATTERNS):
        return None
    validation = sorted(n for n in names if n.startswith("val/"))
    return (f"is {objective!r}, a metric this run never logs, so checkpoints/best would never be written; use "
            f"{' or '.join(validation)}, val/<data_source>/accuracy, or another logged metric "
            "(docs/metrics.md lists them)")
