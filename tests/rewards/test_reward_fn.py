"""Reward functions chosen by import path, and batch scoring with reward.on_error."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ppo_trainer.config import ConfigError, RewardConfig
from ppo_trainer.rewards.loader import load_reward_fn, score_all


def test_builtin_score_gets_mode_and_scores_bound() -> None:
    fn = load_reward_fn(RewardConfig(mode="flexible", format_score=0.1, correct_score=2.0))
    assert fn("it is 5", "5") == 2.0
    assert fn("it is 6", "5") == 0.1
    assert fn("no number", "5") == 0.0


def test_user_function_is_imported_and_called_with_response_and_truth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_rewards.py").write_text("def length_match(response, truth):\n    return float(len(response) == len(truth))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn(RewardConfig(fn="my_rewards:length_match", format_score=0.5))
    assert fn("abc", "xyz") == 1.0
    assert fn("abcd", "xyz") == 0.0


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("no_such_module_xyz:score", "module 'no_such_module_xyz' cannot be imported"),
        ("ppo_trainer.rewards.math:no_such_fn", "has no function 'no_such_fn'"),
        ("ppo_trainer.rewards.math:ANSWER_MARKER", "has no function 'ANSWER_MARKER'"),
        ("ppo_trainer.rewards.math", "expected 'module:function'"),
    ],
)
def test_bad_reward_fn_fails_with_one_line_naming_the_key(fn: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_reward_fn(RewardConfig(fn=fn))
    assert "'reward.fn'" in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def _fragile(response: str, truth: str) -> float:
    if response == "boom":
        raise KeyError("boom")
    return math.nan if response == "nan" else 1.0


def test_score_all_raise_names_the_failing_row() -> None:
    with pytest.raises(RuntimeError, match="row 1 .*reward.on_error=zero"):
        score_all(_fragile, ["ok", "boom"], ["1", "2"])


def test_an_error_quoting_a_multi_line_ground_truth_stays_one_line() -> None:
    def quoting(response: str, truth: str) -> float:
        raise ValueError(f"cannot parse {truth}")

    with pytest.raises(RuntimeError) as err:
        score_all(quoting, ["ok"], ["2 + 6 = 8\n#### 8"])
    assert "\n" not in str(err.value)
    assert "ValueError: cannot parse 2 + 6 = 8\\n#### 8; fix it" in str(err.value)


def test_score_all_zero_scores_failures_zero_and_counts_them() -> None:
    scores, errors = score_all(_fragile, ["ok", "boom", "nan", "ok"], ["1"] * 4, on_error="zero")
    assert scores == [1.0, 0.0, 0.0, 1.0]
    assert errors == 2
