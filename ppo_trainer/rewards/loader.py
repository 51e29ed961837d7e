"""Reward functions chosen by import path (`reward.fn=module:function`), and scoring a batch."""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, Callable, Sequence

from ppo_trainer.config import ConfigError, RewardConfig
from ppo_trainer.rewards import math as math_reward

RewardFn = Callable[[str, Any], float]  # (response, ground truth as in the data) -> score


class RewardError(RuntimeError):
    """The reward function failed on a row (under reward.on_error=raise): the run stops."""


def load_reward_fn(cfg: RewardConfig) -> RewardFn:
    """`cfg.fn` ("module:function") as `fn(response, ground_truth) -> float`; the built-in
    `rewards.math:score` gets `cfg.mode`, `format_score` and `correct_score` bound."""
    module_name, sep, fn_name = cfg.fn.partition(":")
    if not sep or not module_name or not fn_name:
        raise ConfigError(f"'reward.fn' is {cfg.fn!r}; expected 'module:function', e.g. ppo_trainer.rewards.math:score")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"'reward.fn' is {cfg.fn!r}, but module '{e.name}' cannot be imported; "
                          "install it or put it on PYTHONPATH") from None
    except Exception as e:  # the module's own code failed (a syntax error, a file it reads at import...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"'reward.fn' is {cfg.fn!r}, but importing module '{module_name}' failed: "
                          f"{type(e).__name__}: {first}; fix the module") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"'reward.fn' is {cfg.fn!r}, but module '{module_name}' has no function '{fn_name}'")
    if fn is math_reward.score:
        return functools.partial(fn, mode=cfg.mode, format_score=cfg.format_score, correct_score=cfg.correct_score)
    return fn


def score_all(reward_fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[Any],
              on_error: str = "raise") -> tuple[list[float], int]:
    """Scores [B] and the number of failed calls (an exception or a non-finite result): on_error
    "raise" re-raises the first naming the row, "zero" scores it 0.0."""
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    scores, errors = [], 0
    for row, (response, truth) in enumerate(zip(responses, ground_truths)):
        try:
            value = reward_fn(response, truth)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"returned {value!r}; a reward must be a finite number")
            scores.append(float(value))
        except Exception as e:
            if on_error != "zero":
                shown = response if len(response) <= 300 else response[:300] + "..."
                # one line, also when the error quotes a multi-line ground truth (a GSM8K solution)
                reason = f"{type(e).__name__}: {e}".replace("\n", "\\n")
                raise RewardError(f"reward function failed on row {row} (ground truth {truth!r:.300}, response "
                                  f"{shown!r}): {reason}; fix it or set reward.on_error=zero to score such rows "
                                  "0") from e
            scores.append(0.0)
            errors += 1
    return scores, errors
