"""The built-in arithmetic word-problem generator: determinism, format, train/val separation."""

from __future__ import annotations

import re

import pytest

from ppo_trainer.config.schema import ArithmeticConfig
from ppo_trainer.data.arithmetic import generate_problems, in_val_pool
from ppo_trainer.rewards.math import extract_strict


def _answer(row: dict[str, str]) -> int:
    return int(row["answer"].rpartition("####")[2])


def test_same_seed_gives_the_same_problems() -> None:
    cfg = ArithmeticConfig(train_size=300, seed=5)
    assert generate_problems(cfg, "train") == generate_problems(cfg, "train")
    assert generate_problems(cfg, "train") != generate_problems(ArithmeticConfig(train_size=300, seed=6), "train")


def test_validation_set_is_frozen_whatever_the_training_seed() -> None:
    a = generate_problems(ArithmeticConfig(seed=0, train_size=10), "val")
    b = generate_problems(ArithmeticConfig(seed=123, train_size=99), "val")
    assert a == b
    assert len(a) == 256 and len({row["question"] for row in a}) == 256


def test_train_and_validation_never_share_a_question() -> None:
    cfg = ArithmeticConfig(train_size=5000, val_size=300, max_operand=5)
    train = {row["question"] for row in generate_problems(cfg, "train")}
    val = {row["question"] for row in generate_problems(cfg, "val")}
    assert train.isdisjoint(val)
    assert all(in_val_pool(q) for q in val) and not any(in_val_pool(q) for q in train)


def test_answers_are_gsm8k_formatted_non_negative_integers_matching_the_working() -> None:
    rows = generate_problems(ArithmeticConfig(train_size=2000, max_operand=20, two_step_fraction=0.5), "train")
    for row in rows:
        value = _answer(row)
        assert value >= 0
        assert extract_strict(row["answer"]) == str(value)
        last_step = row["answer"].splitlines()[-2]
        left, result = last_step.split(" = ")
        assert int(result) == value == eval(left.replace("/", "//"))  # noqa: S307 - our own "a op b" text


@pytest.mark.parametrize(("fraction", "steps"), [(0.0, {1}), (1.0, {2})])
def test_two_step_fraction_sets_the_number_of_operations(fraction: float, steps: set[int]) -> None:
    rows = generate_problems(ArithmeticConfig(train_size=200, two_step_fraction=fraction), "train")
    assert {len(row["answer"].splitlines()) - 1 for row in rows} == steps


def test_operands_stay_within_max_operand() -> None:
    rows = generate_problems(ArithmeticConfig(train_size=1000, max_operand=6, two_step_fraction=0.5), "train")
    for row in rows:
        first_step = row["answer"].splitlines()[0]
        operands = [int(n) for n in re.findall(r"\d+", first_step.split(" = ")[0])]
        dividend_ok = " / " in first_step and operands[0] <= 36
        assert all(n <= 6 for n in operands[1:]) and (operands[0] <= 6 or dividend_ok)


def test_wording_varies() -> None:
    rows = generate_problems(ArithmeticConfig(train_size=500), "train")
    names = {row["question"].split()[0] for row in rows}
    assert len(names) >= 10
    assert len({row["question"] for row in rows}) >= 490


def test_impossible_validation_size_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppo_trainer.data import arithmetic

    monkeypatch.setattr(arithmetic, "NAMES", ("Ann", "Bob"))
    monkeypatch.setattr(arithmetic, "OBJECTS", ("pens",))
    with pytest.raises(ValueError, match="raise data.arithmetic.max_operand or lower data.arithmetic.val_size"):
        generate_problems(ArithmeticConfig(max_operand=2, val_size=256), "val")
