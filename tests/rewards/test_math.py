"""Strict and flexible answer extraction, numeric comparison and the built-in score."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_trainer.rewards.math import answers_equal, extract_flexible, extract_strict, score, truth_answers

STRICT_CASES = [
    ("#### 72", "72"),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
    ("#### -5", "-5"),
    ("The change is negative.\n####-12", "-12"),
    ("#### 3.75", "3.75"),
    ("#### -0.5", "-0.5"),
    ("#### .5", ".5"),
    ("#### 1,000", "1000"),
    ("#### 1,234,567.89", "1234567.89"),
    ("#### $18", "18"),
    ("#### $ 1,200", "1200"),
    ("#### -$7", "-7"),
    ("#### 18.", "18"),
    ("#### 18 dollars", "18"),
    ("#### 5 first try\n#### 7", "7"),
    ("a #### 1 b #### 2 c #### 3", "3"),
    ("#### 5\n#### the answer is unclear", None),
    ("#### 5\n####", None),
    ("The answer is 42.", None),
    ("", None),
    ("#### ", None),
    ("#### forty-two", None),
    ("#### 1,2,3", "1"),
    ("####\n\n 9", "9"),
]

FLEXIBLE_CASES = [
    ("The answer is 42.", "42"),
    ("3 apples and 4 pears make 7 fruits", "7"),
    ("It costs $1,250.50 in total", "1250.50"),
    ("The temperature drops to -3 degrees", "-3"),
    ("She pays -$4 back", "-4"),
    ("5-3=2", "2"),
    ("pages 10-20", "20"),
    ("x = 10 - 5", "5"),
    ("(4)-2", "2"),
    ("the list 1,2,3", "3"),
    ("ratio 0.25 then 1.5", "1.5"),
    ("#### 8 and then 9 more", "9"),
    ("nothing numeric here", None),
    ("", None),
    ("Total: 1,000,000", "1000000"),
    ("It is 3.", "3"),
]


@pytest.mark.parametrize(("text", "expected"), STRICT_CASES)
def test_extract_strict(text: str, expected: str | None) -> None:
    assert extract_strict(text) == expected


@pytest.mark.parametrize(("text", "expected"), FLEXIBLE_CASES)
def test_extract_flexible(text: str, expected: str | None) -> None:
    assert extract_flexible(text) == expected


@pytest.mark.parametrize(
    ("answer", "truth", "equal"),
    [
        ("3.0", "3", True),
        ("1,000", "1000", True),
        ("$5", "5", True),
        ("-0", "0", True),
        ("0.50", ".5", True),
        ("3.01", "3", False),
        ("-3", "3", False),
        ("abc", "abc", True),
        ("abc", "3", False),
    ],
)
def test_answers_compare_as_numbers(answer: str, truth: str, equal: bool) -> None:
    assert answers_equal(answer, truth) is equal


def test_score_strict_rewards_correct_well_formed_and_missing_answers() -> None:
    assert score("so 2 + 3 = 5\n#### 5", "5") == 1.0
    assert score("#### 5.0", "5", correct_score=2.0) == 2.0
    assert score("#### 6", "5", format_score=0.1) == 0.1
    assert score("the answer is 5", "5", format_score=0.1) == 0.0


def test_score_flexible_takes_the_last_number() -> None:
    assert score("the answer is 5", "5", mode="flexible") == 1.0
    assert score("5 then 6", "5", mode="flexible", format_score=0.2) == 0.2
    assert score("no idea", "5", mode="flexible", format_score=0.2) == 0.0


def test_score_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="reward mode 'loose' is unknown"):
        score("#### 5", "5", mode="loose")


def test_every_gsm8k_train_answer_scores_one_against_its_ground_truth(gsm8k_dir: Path) -> None:
    rows = [json.loads(line) for line in (gsm8k_dir / "train.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 7473
    failures = [row["answer"][-40:] for row in rows if score(row["answer"], row["answer"]) != 1.0]
    assert failures == []


@pytest.mark.parametrize(
    ("truth", "answers"),
    [
        ("48/2 = <<48/2=24>>24\n#### 72", ["72"]),
        ("#### 1,600", ["1600"]),
        ("#### -3", ["-3"]),
        ("first #### 4\nthen #### 5", ["5"]),
        ("42", ["42"]),
        ("  7.5 ", ["7.5"]),
        ("(1, 2)", ["(1, 2)"]),  # only thousands separators go: a tuple keeps its comma
        ("#### $1,250.50", ["1250.50"]),
        (72, ["72"]),
        (2.5, ["2.5"]),
        (["1,000", 7, "#### 8"], ["1000", "7", "8"]),
    ],
)
def test_truth_answers_read_the_ground_truth_as_the_data_gives_it(truth, answers) -> None:
    assert truth_answers(truth) == answers


@pytest.mark.parametrize(
    ("truth", "message"),
    [("reasoning\n####  ", "has nothing after '####'"), (None, "not NoneType"), (True, "not bool"),
     ({"answer": 3}, "not dict"), (["1", ["2"]], r"not list \['2'\] inside a list"), ([], "an empty list")],
)
def test_truth_answers_refuse_what_they_cannot_read(truth, message) -> None:
    with pytest.raises(ValueError, match=message):
        truth_answers(truth)


def test_score_accepts_numbers_lists_and_gsm8k_solutions_as_ground_truth() -> None:
    assert score("#### 72", 72) == 1.0
    assert score("#### 1600", "Natalia ... #### 1,600") == 1.0
    assert score("#### 2.50", 2.5) == 1.0
    assert score("#### 8", [7, "8"]) == 1.0 and score("#### 9", [7, "8"], format_score=0.1) == 0.1
    assert score("the pair is (1, 2)", "(1, 2)", mode="flexible", format_score=0.1) == 0.1  # "2" is no tuple
