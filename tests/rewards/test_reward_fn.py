"""Reward functions chosen by import path or file path, the reward.* options they take, and batch
scoring under reward.on_error."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ppo_trainer.config.schema import ConfigError, RewardConfig
from ppo_trainer.rewards.calling import Calling, RewardError, RewardInput
from ppo_trainer.rewards.scoring import FunctionScorer, build_scorer


def rows(*responses: str, truth: object = "5") -> list[RewardInput]:
    return [RewardInput(r, truth, "src", None, "prompt") for r in responses]


def test_builtin_score_gets_mode_and_scores_given() -> None:
    scorer = build_scorer(RewardConfig(mode="flexible", format_score=0.1, correct_score=2.0))
    assert scorer.score(rows("it is 5", "it is 6", "no number")).values == [2.0, 0.1, 0.0]
    assert dict(scorer.calling.options) == {"mode": "flexible", "format_score": 0.1, "correct_score": 2.0}


def test_builtin_score_at_the_defaults_is_called_without_options() -> None:
    scorer = build_scorer(RewardConfig())
    assert scorer.calling == Calling("pair") and scorer.score(rows("#### 5", "5")).values == [1.0, 0.0]


def test_user_function_is_imported_and_called_with_response_and_truth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_rewards.py").write_text("def length_match(response, truth):\n    return float(len(response) == len(truth))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = build_scorer(RewardConfig(fn="my_rewards:length_match"))
    assert scorer.score(rows("abc", "abcd", truth="xyz")).values == [1.0, 0.0]


def test_a_file_path_names_the_function_relative_to_the_working_folder(tmp_path, monkeypatch) -> None:
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text("LOADS = []\nLOADS.append(1)\n\n"
                                                  "def score(response, truth):\n    return float(len(LOADS))\n")
    monkeypatch.chdir(tmp_path)
    relative = build_scorer(RewardConfig(fn="rewards/mine.py:score"))
    absolute = build_scorer(RewardConfig(fn=f"{tmp_path}/rewards/mine.py:score"))
    assert relative.fn is absolute.fn  # one module per file and process: executed once
    assert relative.score(rows("x")).values == [1.0]


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("no_such_module_xyz:score", "module 'no_such_module_xyz' cannot be imported"),
        ("ppo_trainer.rewards.math:no_such_fn", "ppo_trainer.rewards.math has no function 'no_such_fn'"),
        ("ppo_trainer.rewards.math:ANSWER_MARKER", "has no function 'ANSWER_MARKER'"),
        ("ppo_trainer.rewards.math", "expected 'module:function' or 'path/to/file.py:function'"),
        ("/no/such/dir/reward.py:score", "file /no/such/dir/reward.py not found"),
    ],
)
def test_bad_reward_fn_fails_with_one_line_naming_the_key(fn: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_scorer(RewardConfig(fn=fn))
    assert "'reward.fn'" in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_file_that_fails_when_executed_is_named(tmp_path) -> None:
    (tmp_path / "broken.py").write_text("import json\nCONFIG = json.loads('{not json')\n")
    with pytest.raises(ConfigError, match=rf"executing {tmp_path}/broken.py failed: JSONDecodeError"):
        build_scorer(RewardConfig(fn=f"{tmp_path}/broken.py:score"))


def test_options_given_to_a_function_without_them_are_config_errors(tmp_path) -> None:
    (tmp_path / "plain.py").write_text("def score(response, ground_truth):\n    return 1.0\n")
    fn = f"{tmp_path}/plain.py:score"
    with pytest.raises(ConfigError, match=r"'reward.format_score' is 0.5, but reward.fn .*plain.py:score has no "
                                          r"'format_score' parameter, so the value would be ignored"):
        build_scorer(RewardConfig(fn=fn, format_score=0.5))
    with pytest.raises(ConfigError, match="'reward.mode' is 'flexible'"):
        build_scorer(RewardConfig(fn=fn, mode="flexible"))
    # correct_score is validation's threshold too: accepted, and that is its only use
    assert build_scorer(RewardConfig(fn=fn, correct_score=0.5)).accuracy.threshold_only
    assert not build_scorer(RewardConfig(fn=fn)).accuracy.threshold_only  # the default counts as not given


def test_options_go_to_a_function_that_names_them(tmp_path) -> None:
    (tmp_path / "opts.py").write_text("def score(solution_str, ground_truth, format_score=0.3, correct_score=1.0):\n"
                                      "    return correct_score if solution_str == ground_truth else format_score\n")
    scorer = build_scorer(RewardConfig(fn=f"{tmp_path}/opts.py:score", format_score=0.2, correct_score=3.0))
    assert scorer.score(rows("5", "6")).values == [3.0, 0.2]
    assert not scorer.accuracy.threshold_only
    unset = build_scorer(RewardConfig(fn=f"{tmp_path}/opts.py:score"))
    assert unset.score(rows("6")).values == [0.3]  # not given: the function's own default


def _fragile(response: str, truth: str) -> float:
    if response == "boom":
        raise KeyError("boom")
    return math.nan if response == "nan" else 1.0


def test_raise_names_the_failing_row_and_stops_calling() -> None:
    calls = []

    def counting(response: str, truth: str) -> float:
        calls.append(response)
        return _fragile(response, truth)

    with pytest.raises(RewardError, match=r"row 1 \(data_source src, ground truth '5', response 'boom'\): "
                                          r"KeyError: 'boom'; .*reward.on_error=zero"):
        FunctionScorer(counting, Calling("pair")).score(rows("ok", "boom", "ok"))
    assert calls == ["ok", "boom"]


def test_an_error_quoting_a_multi_line_ground_truth_stays_one_line() -> None:
    def quoting(response: str, truth: str) -> float:
        raise ValueError(f"cannot parse {truth}")

    with pytest.raises(RewardError) as err:
        FunctionScorer(quoting, Calling("pair")).score(rows("ok", truth="2 + 6 = 8\n#### 8"))
    assert "\n" not in str(err.value)
    assert "ValueError: cannot parse 2 + 6 = 8\\n#### 8; fix it" in str(err.value)


def test_zero_scores_failures_zero_and_counts_them() -> None:
    scores = FunctionScorer(_fragile, Calling("pair"), on_error="zero").score(rows("ok", "boom", "nan", "ok"))
    assert scores.values == [1.0, 0.0, 0.0, 1.0]
    assert (scores.errors, scores.timeouts) == (2, 0)
    assert scores.extras == [{}, {}, {}, {}]
