"""The digit tasks of the tiny model (data.source=digits): rows, splits, config checks."""

from __future__ import annotations

from collections import Counter

import pytest

from ppo_trainer.config.schema import ConfigError, DigitsConfig
from ppo_trainer.data.arithmetic import in_val_pool
from ppo_trainer.data.digits import generate_rows


def _sum(question: str) -> int:
    a, b = question.rstrip("=").split("+")
    return int(a) + int(b)


def test_sum_rows_are_one_digit_sums_and_validation_is_the_whole_table() -> None:
    val = generate_rows(DigitsConfig(task="sum"), "val")
    assert len(val) == 55 == len({r["question"] for r in val})
    for row in val + generate_rows(DigitsConfig(task="sum", train_size=500), "train"):
        assert row["question"].endswith("=") and 0 <= _sum(row["question"]) <= 9
        assert row["answer"] == str(_sum(row["question"]))
    train = generate_rows(DigitsConfig(task="sum", train_size=3000, seed=3), "train")
    assert len(train) == 3000 and train == generate_rows(DigitsConfig(task="sum", train_size=3000, seed=3), "train")
    assert {r["question"] for r in train} == {r["question"] for r in val}  # every pair is drawn
    counts = Counter(r["answer"] for r in train)
    assert len(counts) == 10 and all(240 < c < 360 for c in counts.values())  # each answer ~300 times


def test_reverse_rows_hold_out_long_strings_and_keep_every_length_for_training() -> None:
    cfg = DigitsConfig(task="reverse", min_length=1, length=3, train_size=3000, val_size=100)
    train, val = generate_rows(cfg, "train"), generate_rows(cfg, "val")
    assert all(r["question"] == r["answer"][::-1] + "=" for r in train + val)
    lengths = Counter(len(r["answer"]) for r in train)
    assert sorted(lengths) == [1, 2, 3] and all(900 < c < 1100 for c in lengths.values())  # drawn uniformly
    assert len(val) == 100 == len({r["question"] for r in val})
    assert all(len(r["answer"]) == 3 and in_val_pool(r["question"][:3]) for r in val)
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    assert val == generate_rows(DigitsConfig(task="reverse", seed=7, train_size=5), "val")  # frozen


def test_too_few_held_out_strings_is_an_error_naming_the_keys() -> None:
    # 108 of the 1000 three-digit strings are in the validation pool
    with pytest.raises(ValueError, match="only 108 distinct held-out strings of 3 digits .*data.digits.val_size"):
        generate_rows(DigitsConfig(task="reverse", length=3, val_size=200), "val")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["data.digits.task=copy"], "data.digits.task"),
        (["data.digits.min_length=4"], "data.digits.min_length"),
        (["data.digits.min_length=0"], "data.digits.min_length"),
        (["data.digits.val_size=0"], "data.digits.val_size"),
        (["sampler.max_new_tokens=2"], "sampler.max_new_tokens"),
    ],
)
def test_bad_digits_settings_are_config_errors_naming_the_key(overrides: list[str], key: str) -> None:
    from ppo_trainer.config.composition import compose

    with pytest.raises(ConfigError, match=f"^'{key}'"):
        compose(["model=tiny", "data.source=digits", "sampler.max_new_tokens=3", *overrides])


def test_sum_needs_only_one_new_token() -> None:
    from ppo_trainer.config.composition import compose

    cfg = compose(["model=tiny", "data.source=digits", "data.digits.task=sum", "sampler.max_new_tokens=1"])
    assert cfg.data.digits.task == "sum"
