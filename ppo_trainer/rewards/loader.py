"""`reward.fn` found, imported and its calling convention decided (`calling.classify`), before any
model loads: every problem is a ConfigError naming the key."""

from __future__ import annotations

from typing import Any, Callable

from ppo_trainer.config.schema import ConfigError, RewardConfig
from ppo_trainer.rewards.calling import OPTIONS, RewardSpec, SignatureError, absolute_ref, classify, import_reward


def given_options(cfg: RewardConfig) -> dict[str, Any]:
    """The options `reward.mode`, `format_score` and `correct_score` whose value differs from the
    schema's default: the ones a user gave (setting one to its default cannot be told from not setting it)."""
    return {key: getattr(cfg, key) for key in OPTIONS if getattr(cfg, key) != getattr(RewardConfig, key)}


def resolve(cfg: RewardConfig, key: str = "reward.fn") -> tuple[Callable[..., Any], RewardSpec]:
    """The function `cfg.fn` (the config's `key`) names and how to call it. A given option (`given_options`) goes to a
    function that names it as a parameter; `reward.mode` or `reward.format_score` given to one that
    does not is a ConfigError (it would be ignored). `reward.correct_score` is also validation's
    threshold, so a function need not take it (`scoring.accuracy_rule`)."""
    try:
        fn = import_reward(cfg.fn)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"'{key}' is {cfg.fn!r}, but {e}") from None
    given = given_options(cfg)
    try:
        calling = classify(fn, cfg.batched, given)
    except SignatureError as e:
        raise ConfigError(f"'{key}' is {cfg.fn!r} (reward.batched={str(cfg.batched).lower()}), but {e}") from None
    taken = dict(calling.options)
    for option in ("mode", "format_score"):
        if option in given and option not in taken:
            raise ConfigError(f"'reward.{option}' is {given[option]!r}, but {key} {cfg.fn} has no '{option}' parameter, "
                              f"so the value would be ignored; remove reward.{option} (reward.mode, format_score and "
                              "correct_score are passed to a function that names them)")
    return fn, RewardSpec(absolute_ref(cfg.fn), calling)
