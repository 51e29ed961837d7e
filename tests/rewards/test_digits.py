"""The reward of the digit tasks: the response begins with the answer."""

from __future__ import annotations

import pytest

from ppo_trainer.rewards.digits import score


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [("321", "321", 1.0), ("321xy", "321", 1.0), (" 7\n", "7", 1.0), ("32", "321", 0.0), ("x321", "321", 0.0),
     ("021", "21", 0.0), ("", "7", 0.0), ("9", "", 0.0)],
)
def test_score_is_one_when_the_response_begins_with_the_answer(response: str, truth: str, expected: float) -> None:
    assert score(response, truth) == expected
