"""A seeded generator of easy GSM8K-format word problems, for offline demos a 135M model can learn.

Each problem takes one or two operations (+, -, x, /) on whole numbers from 1 to `max_operand`;
every answer is a non-negative integer and the answer string ends in "#### N", like GSM8K.
Wording varies through names, objects and sentence templates.

Train and validation never share a question: a question belongs to the validation pool exactly
when a hash of its text falls in one bucket out of `VAL_BUCKETS`, and each split keeps only its
own pool's questions. The validation set is drawn with the fixed seed `VAL_SEED` (not the
training seed) and holds `val_size` distinct questions, so its accuracy compares across runs.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable

from ppo_trainer.config import ArithmeticConfig

VAL_SEED = 1_000_003
VAL_BUCKETS = 10  # one in ten distinct questions belongs to the validation pool
MAX_MISSES = 10_000  # consecutive rejected draws before a split counts as impossible

NAMES = ("Ava", "Ben", "Chloe", "David", "Emma", "Finn", "Grace", "Hugo", "Isla", "Jack",
         "Kira", "Leo", "Maya", "Noah", "Olivia", "Sam", "Tara", "Omar", "Lena", "Ravi")
OBJECTS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "shells", "cards",
           "balloons", "stamps", "oranges", "coins", "buttons", "candies", "toy cars", "flowers")

Problem = tuple[str, str]  # (question, answer)
Draw = Callable[[random.Random, int], Problem]


def _names(rng: random.Random) -> tuple[str, str]:
    first, second = rng.sample(NAMES, 2)
    return first, second


def _add(rng: random.Random, top: int) -> Problem:
    a, b = rng.randint(1, top), rng.randint(1, top)
    x, y = _names(rng)
    obj = rng.choice(OBJECTS)
    question = rng.choice((
        f"{x} has {a} {obj}. {y} gives {x} {b} more {obj}. How many {obj} does {x} have now?",
        f"{x} picked {a} {obj} in the morning and {b} {obj} in the afternoon. How many {obj} did {x} pick in total?",
        f"There are {a} {obj} in a box and {b} {obj} on the table. How many {obj} are there altogether?",
    ))
    return question, f"{a} + {b} = {a + b}\n#### {a + b}"


def _subtract(rng: random.Random, top: int) -> Problem:
    a, b = sorted((rng.randint(1, top), rng.randint(1, top)), reverse=True)
    x, y = _names(rng)
    obj = rng.choice(OBJECTS)
    question = rng.choice((
        f"{x} has {a} {obj} and gives {b} of them to {y}. How many {obj} does {x} have left?",
        f"A shop had {a} {obj}. It sold {b} {obj}. How many {obj} does the shop have now?",
        f"{x} had {a} {obj} and lost {b} of them. How many {obj} does {x} have now?",
    ))
    return question, f"{a} - {b} = {a - b}\n#### {a - b}"


def _multiply(rng: random.Random, top: int) -> Problem:
    a, b = rng.randint(1, top), rng.randint(1, top)
    x, _ = _names(rng)
    obj = rng.choice(OBJECTS)
    question = rng.choice((
        f"{x} buys {a} bags with {b} {obj} in each bag. How many {obj} does {x} buy?",
        f"There are {a} rows of {obj} with {b} {obj} in each row. How many {obj} are there?",
    ))
    return question, f"{a} * {b} = {a * b}\n#### {a * b}"


def _divide(rng: random.Random, top: int) -> Problem:
    share, people = rng.randint(1, top), rng.randint(2, top)
    total = share * people
    x, _ = _names(rng)
    obj = rng.choice(OBJECTS)
    question = rng.choice((
        f"{x} shares {total} {obj} equally among {people} friends. How many {obj} does each friend get?",
        f"{x} puts {total} {obj} into {people} boxes with the same number in each box. How many {obj} are in each box?",
    ))
    return question, f"{total} / {people} = {share}\n#### {share}"


def _add_then_subtract(rng: random.Random, top: int) -> Problem:
    a, b = rng.randint(1, top), rng.randint(1, top)
    c = rng.randint(1, min(top, a + b))
    x, y = _names(rng)
    obj = rng.choice(OBJECTS)
    question = (f"{x} has {a} {obj}. {x} buys {b} more and then gives {c} to {y}. "
                f"How many {obj} does {x} have now?")
    return question, f"{a} + {b} = {a + b}\n{a + b} - {c} = {a + b - c}\n#### {a + b - c}"


def _multiply_then_add(rng: random.Random, top: int) -> Problem:
    a, b, c = rng.randint(1, top), rng.randint(1, top), rng.randint(1, top)
    x, _ = _names(rng)
    obj = rng.choice(OBJECTS)
    question = (f"{x} buys {a} packs of {obj} with {b} {obj} in each pack and finds {c} more {obj}. "
                f"How many {obj} does {x} have?")
    return question, f"{a} * {b} = {a * b}\n{a * b} + {c} = {a * b + c}\n#### {a * b + c}"


def _multiply_then_subtract(rng: random.Random, top: int) -> Problem:
    a, b = rng.randint(1, top), rng.randint(1, top)
    c = rng.randint(1, min(top, a * b))
    x, y = _names(rng)
    obj = rng.choice(OBJECTS)
    question = (f"{x} has {a} boxes with {b} {obj} in each box. {x} gives {c} {obj} to {y}. "
                f"How many {obj} does {x} have left?")
    return question, f"{a} * {b} = {a * b}\n{a * b} - {c} = {a * b - c}\n#### {a * b - c}"


ONE_STEP: tuple[Draw, ...] = (_add, _subtract, _multiply, _divide)
TWO_STEP: tuple[Draw, ...] = (_add_then_subtract, _multiply_then_add, _multiply_then_subtract)


def in_val_pool(question: str) -> bool:
    """True if `question` belongs to the validation pool (a stable hash of its text)."""
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") % VAL_BUCKETS == 0


def draw_problem(rng: random.Random, max_operand: int, two_step_fraction: float) -> Problem:
    """One (question, answer) pair; two-step with probability `two_step_fraction`."""
    family = TWO_STEP if rng.random() < two_step_fraction else ONE_STEP
    return rng.choice(family)(rng, max_operand)


def draw_split(draw: Callable[[random.Random], tuple[str, dict[str, str], bool]], want_val: bool, seed: int,
               size: int) -> list[dict[str, str]]:
    """Up to `size` rows of one split from `draw(rng) -> (question, row, held_out)`: training rows
    (held_out False) drawn with `seed`, repeats allowed; validation rows (held_out True) drawn with
    VAL_SEED, each question once. Fewer rows when MAX_MISSES draws in a row find none: the pool is
    exhausted, and the caller says which keys to change."""
    rng = random.Random(VAL_SEED if want_val else seed)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    misses = 0  # draws since the last accepted one
    while len(rows) < size and misses < MAX_MISSES:
        question, row, held_out = draw(rng)
        if held_out != want_val or (want_val and question in seen):
            misses += 1
            continue
        misses = 0
        if want_val:
            seen.add(question)
        rows.append(row)
    return rows


def generate_problems(cfg: ArithmeticConfig, split: str) -> list[dict[str, str]]:
    """Rows {"question", "answer"} of one split: "train" (`cfg.train_size` rows, seeded by
    `cfg.seed`, repeats allowed) or "val" (`cfg.val_size` distinct rows, seeded by VAL_SEED).

    Raises ValueError if the validation pool is too small for `cfg.val_size` distinct questions.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    want_val = split == "val"
    size = cfg.val_size if want_val else cfg.train_size

    def draw(rng: random.Random) -> tuple[str, dict[str, str], bool]:
        question, answer = draw_problem(rng, cfg.max_operand, cfg.two_step_fraction)
        return question, {"question": question, "answer": answer}, in_val_pool(question)

    rows = draw_split(draw, want_val, cfg.seed, size)
    if len(rows) < size:
        raise ValueError(
            f"data.arithmetic: found only {len(rows)} distinct {split} problems of the {size} asked for; "
            "raise data.arithmetic.max_operand or lower data.arithmetic.val_size"
        )
    return rows
