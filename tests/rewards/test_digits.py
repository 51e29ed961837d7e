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


def test_an_int_ground_truth_is_read_as_written_and_other_types_are_refused() -> None:
    assert score("42 is it", 42) == 1.0
    assert score("4", 42) == 0.0
    with pytest.raises(ValueError, match="string or an int ground truth, not list"):
        score("42", [42])
