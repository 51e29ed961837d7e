"""Each schema field's allowed values sit beside its default (a `Rule`); one loop checks every field
against its rule (config/validation.py), with one line that names the key."""

from __future__ import annotations

import re
from typing import Any, Union, get_args, get_origin

import pytest
from omegaconf import OmegaConf

from ppo_trainer.config.composition import compose
from ppo_trainer.config.schema import ConfigError, Rule, schema_rules
from ppo_trainer.config.validation import check_fields, field_problem, validate_static

RULES = schema_rules()


def refused(rule: Rule) -> Any:
    """A value the rule refuses: outside its choices, just past its bound, or a string it does not match."""
    if rule.allowed:
        return "bogus" if isinstance(rule.allowed[0], str) else max(rule.allowed) + 1
    if rule.pattern:
        return next(v for v in ("", "a b", "nocolon") if not re.fullmatch(rule.pattern, v))
    if rule.op:
        return rule.low - 1 if rule.op == ">=" else rule.low
    low, high = (float(x) for x in rule.interval[1:-1].split(","))
    return low if rule.interval[0] == "(" else high + 1 if rule.interval[-1] == "]" else high


def nullable(hint: Any) -> bool:
    return get_origin(hint) is Union and type(None) in get_args(hint)


@pytest.fixture(scope="module")
def defaults():
    return compose([])


@pytest.mark.parametrize("key", sorted(RULES))
def test_every_field_with_a_rule_refuses_a_value_outside_it_naming_its_key(defaults, key):
    rule, hint = RULES[key]
    bad = refused(rule)
    cfg = defaults.copy()
    OmegaConf.update(cfg, key, [bad] * (rule.length or 1) if get_origin(hint) is list else bad, merge=False)
    with pytest.raises(ConfigError, match=rf"^'{re.escape(key)}' (is|has|must) "):
        validate_static(cfg)


@pytest.mark.parametrize("key", sorted(k for k, (_, hint) in RULES.items() if nullable(hint)))
def test_a_field_that_may_be_null_passes_its_rule_with_null(defaults, key):
    cfg = defaults.copy()
    OmegaConf.update(cfg, key, None, merge=False)
    check_fields(cfg)


def test_the_critic_optimizer_has_the_actors_rules():
    actor = {k.removeprefix("model.optim."): r for k, r in RULES.items() if k.startswith("model.optim.")}
    critic = {k.removeprefix("critic.optim."): r for k, r in RULES.items() if k.startswith("critic.optim.")}
    assert actor == critic and sorted(actor) == ["betas", "eps", "lr", "min_lr_ratio", "schedule", "warmup_steps",
                                                 "weight_decay"]


# (overrides, the whole one-line message): the texts the per-key checks wrote before the rules moved
MESSAGES = [
    (["gae.kl_penalty=k9"], "'gae.kl_penalty' is 'k9'; allowed values: k1, abs, k2, k3"),
    (["trainer.loggers=[console,bogus]"],
     "'trainer.loggers' has 'bogus'; allowed values: console, jsonl, tensorboard, wandb, mlflow"),
    (["reward.num_workers=-1"], "'reward.num_workers' must be >= 0, got -1"),
    (["critic.optim.lr=0"], "'critic.optim.lr' must be > 0, got 0.0"),
    (["gae.lam=2"], "'gae.lam' must be in [0, 1], got 2.0"),
    (["model.optim.betas=[0.9,1.0]"], "'model.optim.betas' must be 2 values in [0, 1), got [0.9, 1.0]"),
    (["data.train_files=[a.jsonl]", "data.train_weights=[0]"],
     "'data.train_weights' must all be > 0 (a file weighted 0 is never read: remove it), got [0.0]"),
    (["reward.num_workers=1", "reward.timeout_s=0"], "'reward.timeout_s' must be > 0, or null for no bound, got 0.0"),
    (["eval.temperature=-1"], "'eval.temperature' must be >= 0 (0: greedy), or null for greedy at eval.n=1 and "
                              "sampler.temperature above, got -1.0"),
    (["reward.fn=my_rewards.score"], "'reward.fn' is 'my_rewards.score'; expected 'module:function' or "
                                     "'path/to/file.py:function', or null"),
    (["trainer.experiment_name=a b"], "'trainer.experiment_name' is 'a b'; expected letters, digits, '.', '_' and "
                                      "'-' only (it names folders: outputs/<name>)"),
]


@pytest.mark.parametrize(("overrides", "message"), MESSAGES, ids=[" ".join(m[0]) for m in MESSAGES])
def test_a_refused_value_is_one_line_naming_the_key_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert str(err.value) == message


def test_a_rule_for_a_list_holds_for_each_value_and_its_length():
    rule = Rule(interval="[0, 1)", length=2)
    assert field_problem(rule, [0.5, 0.9], nullable=False) is None
    assert field_problem(rule, [0.5], nullable=False) == "must be 2 values in [0, 1), got [0.5]"
    assert field_problem(Rule(allowed=("a", "b")), ["a", "c"], nullable=False) == "has 'c'; allowed values: a, b"


def test_the_cross_key_rules_still_run_after_the_fields_pass():
    with pytest.raises(ConfigError, match=r"^'algorithm.ppo_mini_batch_size' \(3\) must divide data.train_batch_size"):
        compose(["algorithm.ppo_mini_batch_size=3"])
