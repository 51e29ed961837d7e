"""The metric catalogue (`metric_names`) and docs/metrics.md against what runs log: trainer.objective
is checked against the catalogue before anything loads, so it must name exactly what a run writes,
and the page must list every name a run can write, and nothing no run writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ppo_trainer.config import metric_names
from ppo_trainer.config.composition import compose
from ppo_trainer.config.derived import uses_reference
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.trainer import run_training

METRICS_MD = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
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
    "a reward model and mis": ["reward.model.path=random:tiny-reward", "algorithm.rollout_correction=mis",
                               "trainer.total_steps=1"],
    "critic-free (grpo), filtered groups": ["algorithm.adv_estimator=grpo", "trainer.total_steps=1",
                                           "algorithm.filter_groups=true", "algorithm.filter_groups_max_draws=2"],
    "multi-turn (an environment)": ["sampler.multi_turn.env=ppo_trainer.agents.tasks:RevealDigit",
                                    "trainer.total_steps=1"],
}


# Configs whose runs need more than these smoke runs (Ray and vLLM): only their catalogue counts here, and
# the test named holds it to a run's records.
CATALOGUED = {  # tests/workers/cluster/test_async_on_ray.py (slow)
    "partial rollouts": ["sampler=vllm", "devices.backend=ray", "algorithm.rollout_correction=tis",
                         "sampler.max_staleness=1", "sampler.partial_rollouts=true"],
}


def variant_config(tmp_path: Path, variant: str):
    return compose(["+experiment=smoke", f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]",
                    "trainer.save_every=0", "trainer.total_steps=2", *VARIANTS[variant]])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[object, set[str]]]:
    """Each variant's config and the metric names its smoke run wrote to metrics.jsonl."""
    logged = {}
    for variant in VARIANTS:
        out = tmp_path_factory.mktemp("run")
        cfg = variant_config(out, variant)
        run_training(cfg)
        names = {k for line in (out / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)} - {"step"}
        logged[variant] = (cfg, names)
    return logged


def documented() -> tuple[set[str], list[re.Pattern]]:
    """The names docs/metrics.md lists (each backquoted in full in a table's first column) and its
    patterns (those with `<...>` or `@N`, made regular expressions)."""
    names, patterns = set(), []
    for line in METRICS_MD.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        for token in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "<" in token or "@N" in token:
                patterns.append(re.compile(re.sub(r"<[^>]+>", ".+", re.escape(token)).replace("@N", r"@\d+")))
            else:
                names.add(token)
    return names, patterns


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_catalogue_names_exactly_what_a_smoke_run_logs(runs, variant):
    cfg, logged = runs[variant]
    fixed = {k for k in logged if not any(p.fullmatch(k) for p in metric_names.PATTERNS)}
    assert fixed == metric_names.produced(cfg, uses_reference(cfg))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_metric_a_smoke_run_logs_is_listed_in_docs_metrics(runs, variant):
    names, patterns = documented()
    _, logged = runs[variant]
    assert sorted(k for k in logged if k not in names and not any(p.fullmatch(k) for p in patterns)) == []


def test_every_name_docs_metrics_lists_is_logged_by_a_smoke_run_or_in_the_catalogue(runs):
    names, _ = documented()
    configs = [cfg for cfg, _ in runs.values()] + [compose(["+experiment=smoke", *o]) for o in CATALOGUED.values()]
    produced = set().union(*(metric_names.produced(cfg, uses_reference(cfg)) for cfg in configs))
    logged = set().union(*(names_logged for _, names_logged in runs.values()))
    assert sorted(names - produced - logged) == []


def test_the_docs_patterns_read_as_the_catalogues():
    _, patterns = documented()
    for name in ("val/gsm8k/accuracy", "val/openai/gsm8k/score/mean", "val/accuracy/pass@4", "val/a/accuracy/mean@2",
                 "reward/acc/mean", "reward/remote/mean", "reward/remote/format/mean", "multi_turn/end/env_done",
                 "multi_turn/env/solved_at_first_turn"):
        assert any(p.fullmatch(name) for p in patterns), name
        assert any(p.fullmatch(name) for p in metric_names.PATTERNS), name


def test_an_objective_no_run_logs_is_a_config_error_naming_the_logged_ones():
    with pytest.raises(ConfigError, match=r"'trainer.objective' is 'val/acc', a metric this run never logs.*"
                                          r"val/accuracy or val/score/mean"):
        compose(["+experiment=smoke", "trainer.objective=val/acc"])
    with pytest.raises(ConfigError, match="actor/update_entropy"):
        compose(["+experiment=smoke", "trainer.objective=actor/update_entropy"])  # entropy_coef=0: never logged
    for fine in ("critic/vf_loss", "val/gsm8k/accuracy", "val/openai/gsm8k/accuracy/pass@4", "val/accuracy/mean@4",
                 "reward/format/mean"):
        assert compose(["+experiment=smoke", f"trainer.objective={fine}"]).trainer.objective == fine
