"""`reward.fn` found, imported and its calling convention decided (`calling.classify`), and its
workers started, before any model loads: every problem is a ConfigError naming the key. Also the
check a ground truth must pass at load for the function that will score it (`answer_check`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from ppo_trainer.config.schema import ConfigError, RewardConfig
from ppo_trainer.rewards.calling import OPTIONS, RewardSpec, SignatureError, absolute_ref, classify, import_reward
from ppo_trainer.rewards.math import truth_answers
from ppo_trainer.rewards.pool import LoadError, WorkerPool

MATH_REWARD = "ppo_trainer.rewards.math:score"  # the built-in reward, reward.fn's default


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


def start_workers(cfg: RewardConfig, spec: RewardSpec, key: str = "reward.fn") -> Optional[WorkerPool]:
    """`reward.num_workers` processes calling `spec`'s function, each call bounded by `reward.timeout_s`;
    None for 0 (calls run in the driver). A worker whose import of the function fails is a
    ConfigError naming `key`: the driver imported it, but a module may act differently in a fresh
    process (it reads the process id, an environment variable, a file relative to the folder)."""
    if cfg.num_workers == 0:
        return None
    try:
        return WorkerPool(spec, cfg.num_workers, cfg.timeout_s)
    except LoadError as e:
        raise ConfigError(f"'{key}' is {cfg.fn!r}, but a reward worker could not load it: {e.reason}") from None


def answer_check(cfg: Any, split: str) -> Optional[Callable[[Any], None]]:
    """What the data loader asks of each ground truth of `split` ("train": scored by reward.fn;
    "val": by eval.reward_fn, else reward.fn): for the built-in math reward, that it can read it
    (`math.truth_answers`, the reward's own rule: ValueError naming the key and why not); None for
    any other function, which decides its own format."""
    key = "eval.reward_fn" if split == "val" and cfg.eval.reward_fn else "reward.fn"
    if OmegaConf.select(cfg, key) != MATH_REWARD:
        return None

    def check(ground_truth: Any) -> None:
        try:
            truth_answers(ground_truth)
        except ValueError as e:
            raise ValueError(f"{key}={MATH_REWARD} cannot read it: {e}") from None

    return check
