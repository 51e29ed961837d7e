"""The arithmetic generator's keys (data.arithmetic.*): a curriculum that cannot make the problems it
asks for, or a value out of range, is a one-line ConfigError naming the key (exit 2) before anything
loads; a change of the training operations is refused on resume like the other training keys."""

from __future__ import annotations

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.run.resume import REFUSED


def test_no_training_operation_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        compose(["data.arithmetic.operations=[]"])
    assert str(err.value) == "'data.arithmetic.operations' is empty; list at least one of +, -, *, /"


def test_two_step_problems_without_a_two_step_form_among_the_operations_are_refused() -> None:
    with pytest.raises(ConfigError) as err:
        compose(["data.arithmetic.operations=[+,/]", "data.arithmetic.two_step_fraction=0.3"])
    assert str(err.value) == (
        "'data.arithmetic.two_step_fraction' is 0.3, but data.arithmetic.operations [+, /] make no two-step problem "
        "(+ then -, * then +, * then -); add the operations of one, or set data.arithmetic.two_step_fraction=0")
    cfg = compose(["data.arithmetic.operations=[+,/]", "data.arithmetic.two_step_fraction=0"])
    assert list(cfg.data.arithmetic.operations) == ["+", "/"]
    assert compose(["data.arithmetic.operations=[*,-]"]).data.arithmetic.two_step_fraction == 0.3


@pytest.mark.parametrize(("override", "key"), [
    ("data.arithmetic.operations=[+,%]", "data.arithmetic.operations"),
    ("data.arithmetic.val_max_operand=1", "data.arithmetic.val_max_operand"),
    ("data.arithmetic.val_two_step_fraction=1.5", "data.arithmetic.val_two_step_fraction"),
    ("data.arithmetic.hard_val_size=-1", "data.arithmetic.hard_val_size"),
    ("data.arithmetic.hard_max_operand=1", "data.arithmetic.hard_max_operand"),
])
def test_out_of_range_values_are_one_line_naming_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert str(err.value).startswith(f"'{key}'") and "\n" not in str(err.value)


def test_the_defaults_keep_todays_generator() -> None:
    a = compose([]).data.arithmetic
    assert (list(a.operations), a.val_max_operand, a.val_two_step_fraction, a.hard_val_size) == \
        (["+", "-", "*", "/"], None, None, 0)


def test_changing_the_training_operations_is_refused_on_resume_and_the_validation_keys_are_not() -> None:
    assert "data.arithmetic.operations" in REFUSED
    assert not {f"data.arithmetic.{key}" for key in ("val_max_operand", "val_two_step_fraction", "hard_val_size",
                                                     "hard_max_operand")} & set(REFUSED)
