"""The built-in arithmetic word-problem generator: determinism, format, train/val separation, the
training curriculum's keys, the two frozen validation sets, today's problems under the default keys."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from ppo_trainer.config.schema import ARITHMETIC_OPERATIONS, ARITHMETIC_TWO_STEP, ArithmeticConfig
from ppo_trainer.data.arithmetic import (
    HARD_SOURCE,
    ONE_STEP,
    SOURCE,
    TWO_STEP,
    describe,
    forms,
    generate_hard_problems,
    generate_problems,
    generate_sources,
    in_val_pool,
)
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


# Fingerprints of the problems drawn before the curriculum and the hard set existed (commit 400b0f6):
# the defaults and today's CPU recipe (max_operand=10, two_step_fraction=0) must keep drawing them.
TODAY = {  # (max_operand, two_step_fraction) -> (sha256 of the training rows, of the validation rows)[:16]
    (20, 0.3): ("c39795fb960b7ba1", "0f5f8c6dc768a054"),
    (10, 0.0): ("ef231b9d20b8d213", "7d8703fe454be3a4"),
}


def _fingerprint(rows: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _operands(row: dict[str, str]) -> list[int]:
    """The numbers of the question's working: both operands of the first step, the second step's last."""
    steps = [line.split(" = ")[0].split() for line in row["answer"].splitlines()[:-1]]
    return [int(steps[0][0]), int(steps[0][2])] + [int(step[2]) for step in steps[1:]]


def _form(row: dict[str, str]) -> str:
    return "".join(line.split()[1] for line in row["answer"].splitlines()[:-1])


@pytest.mark.parametrize(("max_operand", "fraction"), list(TODAY))
def test_default_keys_draw_todays_training_and_validation_problems(max_operand: int, fraction: float) -> None:
    cfg = ArithmeticConfig(max_operand=max_operand, two_step_fraction=fraction)
    assert (_fingerprint(generate_problems(cfg, "train")), _fingerprint(generate_problems(cfg, "val"))) == \
        TODAY[(max_operand, fraction)]
    pinned = ArithmeticConfig(max_operand=max_operand, two_step_fraction=fraction, val_max_operand=max_operand,
                              val_two_step_fraction=fraction, hard_val_size=256)
    assert generate_sources(pinned, "val")[SOURCE] == generate_problems(cfg, "val")
    assert generate_sources(pinned, "train") == {SOURCE: generate_problems(cfg, "train")}


def test_todays_recipe_starts_with_the_same_problems() -> None:
    cfg = ArithmeticConfig(max_operand=10, two_step_fraction=0.0)
    assert generate_problems(cfg, "train")[:2] == [
        {"question": "Tara puts 6 buttons into 6 boxes with the same number in each box. How many buttons are in "
                     "each box?", "answer": "6 / 6 = 1\n#### 1"},
        {"question": "Tara buys 10 bags with 4 stamps in each bag. How many stamps does Tara buy?",
         "answer": "10 * 4 = 40\n#### 40"}]
    assert generate_problems(cfg, "val")[0] == {
        "question": "Tara buys 9 bags with 3 toy cars in each bag. How many toy cars does Tara buy?",
        "answer": "9 * 3 = 27\n#### 27"}


def test_a_pinned_one_step_set_stays_when_the_training_curriculum_changes() -> None:
    today = generate_problems(ArithmeticConfig(max_operand=10, two_step_fraction=0.0), "val")
    curriculum = ArithmeticConfig(max_operand=60, two_step_fraction=0.5, operations=["+", "-"], seed=7,
                                  train_size=50, val_max_operand=10, val_two_step_fraction=0.0)
    assert generate_problems(curriculum, "val") == today
    assert _fingerprint(today) == TODAY[(10, 0.0)][1]


def test_the_hard_set_is_frozen_whatever_the_other_keys() -> None:
    hard = generate_hard_problems(ArithmeticConfig(hard_val_size=64))
    others = ArithmeticConfig(hard_val_size=64, seed=9, max_operand=7, two_step_fraction=1.0, operations=["*", "+"],
                              val_size=10, val_max_operand=99, val_two_step_fraction=0.5, train_size=3)
    assert generate_hard_problems(others) == hard
    assert generate_hard_problems(ArithmeticConfig(hard_val_size=200))[:64] == hard  # a larger set extends it
    assert hard[0] == {"question": "Leo has 17 oranges. Leo buys 40 more and then gives 37 to Omar. How many oranges "
                                   "does Leo have now?", "answer": "17 + 40 = 57\n57 - 37 = 20\n#### 20"}


def test_the_hard_set_has_two_operations_of_every_form_and_larger_numbers() -> None:
    hard = generate_hard_problems(ArithmeticConfig(hard_val_size=256, hard_max_operand=50))
    one_step = generate_problems(ArithmeticConfig(max_operand=10, two_step_fraction=0.0), "val")
    assert {len(row["answer"].splitlines()) - 1 for row in hard} == {2}
    assert {_form(row) for row in hard} == set(ARITHMETIC_TWO_STEP)
    operands = [_operands(row) for row in hard]
    assert max(max(numbers) for numbers in operands) == 50 and min(min(numbers) for numbers in operands) >= 1
    assert sum(max(numbers) > 10 for numbers in operands) / len(hard) > 0.95
    assert max(max(_operands(row)) for row in one_step if _form(row) != "/") == 10  # a dividend is a product
    for row in hard:  # the working is right and the answer a non-negative integer
        first, second = row["answer"].splitlines()[:2]
        partial = eval(first.split(" = ")[0])  # noqa: S307 - our own "a op b" text
        assert int(first.split(" = ")[1]) == partial and second.startswith(f"{partial} ")
        assert _answer(row) == eval(second.split(" = ")[0]) >= 0  # noqa: S307


def test_frozen_sets_are_disjoint_from_training_and_from_each_other() -> None:
    cfg = ArithmeticConfig(train_size=20000, max_operand=50, two_step_fraction=0.5, hard_val_size=256,
                           val_max_operand=10, val_two_step_fraction=0.0)
    train = {row["question"] for row in generate_problems(cfg, "train")}
    sets = {name: [row["question"] for row in rows] for name, rows in generate_sources(cfg, "val").items()}
    assert list(sets) == [SOURCE, HARD_SOURCE] and [len(q) for q in sets.values()] == [256, 256]
    assert all(len(set(questions)) == 256 and train.isdisjoint(questions) for questions in sets.values())
    assert set(sets[SOURCE]).isdisjoint(sets[HARD_SOURCE])


def test_training_draws_only_the_configured_operations() -> None:
    rows = generate_problems(ArithmeticConfig(train_size=500, two_step_fraction=0.5, operations=["+", "-"]), "train")
    assert {_form(row) for row in rows} == {"+", "-", "+-"}
    times = generate_problems(ArithmeticConfig(train_size=100, two_step_fraction=0.0, operations=["*"]), "train")
    assert {_form(row) for row in times} == {"*"}


def test_the_generators_forms_are_the_schemas_operations() -> None:
    assert tuple(ONE_STEP) == ARITHMETIC_OPERATIONS and tuple(TWO_STEP) == ARITHMETIC_TWO_STEP
    assert [len(family) for family in forms(["*", "-"])] == [2, 1]


def test_an_impossible_hard_set_names_its_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppo_trainer.data import arithmetic

    monkeypatch.setattr(arithmetic, "NAMES", ("Ann", "Bob"))
    monkeypatch.setattr(arithmetic, "OBJECTS", ("pens",))
    with pytest.raises(ValueError) as err:
        generate_hard_problems(ArithmeticConfig(hard_max_operand=2, hard_val_size=256))
    found, _, rest = str(err.value).removeprefix("data.arithmetic: found only ").partition(" ")
    assert int(found) < 256 and rest == ("distinct hard validation problems of the 256 asked for; raise "
                                         "data.arithmetic.hard_max_operand or lower data.arithmetic.hard_val_size")


def test_the_plan_describes_the_curriculum_and_each_validation_set() -> None:
    cfg = ArithmeticConfig(operations=["+", "*"], two_step_fraction=0.25, max_operand=30, val_max_operand=10,
                           val_two_step_fraction=0.0, hard_val_size=128, hard_max_operand=60)
    assert describe(cfg, "train") == "20000 problems of + *, 25% with two operations, numbers up to 30"
    assert describe(cfg, "val") == ("arithmetic (256 problems, one operation each, numbers up to 10) and "
                                    "arithmetic/hard (128 problems, two operations each, numbers up to 60)")
    assert describe(ArithmeticConfig(), "val") == "arithmetic (256 problems, 30% with two operations, numbers up to 20)"
