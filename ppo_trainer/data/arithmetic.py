"""A seeded generator of easy GSM8K-format word problems ("#### N") that a 135M model can learn:
one or two operations on whole numbers from 1 to `max_operand`, with non-negative integer answers.

Train and validation never share a question (a hash of its text picks the validation pool); the
validation set is drawn with the fixed `VAL_SEED`, so it is comparable across runs.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import random
from typing import Callable

from ppo_trainer.config.schema import ArithmeticConfig, DigitsConfig

VAL_SEED = 1_000_003
VAL_BUCKETS = 10  # one in ten distinct questions belongs to the validation pool
MAX_MISSES = 10_000  # consecutive rejected draws before a split counts as impossible

NAMES = ("Ava", "Ben", "Chloe", "David", "Emma", "Finn", "Grace", "Hugo", "Isla", "Jack",
         "Kira", "Leo", "Maya", "Noah", "Olivia", "Sam", "Tara", "Omar", "Lena", "Ravi")
OBJECTS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "shells", "cards",
           "balloons", "stamps", "oranges", "coins", "buttons", "candies", "toy cars", "flowers")

Problem = tuple[str, str]  # (question, answer)


def _words(rng: random.Random, templates: tuple[str, ...], **numbers: int) -> str:
    """One of `templates` with two distinct names {x} {y}, an object {obj} and `numbers` filled
    in; a single template costs no draw."""
    x, y = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    template = templates[0] if len(templates) == 1 else rng.choice(templates)
    return template.format(x=x, y=y, obj=obj, **numbers)


OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _one_step(rng: random.Random, top: int, op: str, templates: tuple[str, ...]) -> Problem:
    """`a op b` with operands up to `top`; a difference puts the larger operand first."""
    a, b = rng.randint(1, top), rng.randint(1, top)
    if op == "-":
        a, b = max(a, b), min(a, b)
    result = OPS[op](a, b)
    return _words(rng, templates, a=a, b=b), f"{a} {op} {b} = {result}\n#### {result}"


def _two_step(rng: random.Random, top: int, first: str, second: str, template: str) -> Problem:
    """`(a first b) second c`; a subtracted `c` is at most `a first b`, so the answer stays >= 0."""
    a, b = rng.randint(1, top), rng.randint(1, top)
    partial = OPS[first](a, b)
    c = rng.randint(1, min(top, partial) if second == "-" else top)
    result = OPS[second](partial, c)
    question = _words(rng, (template,), a=a, b=b, c=c)
    return question, f"{a} {first} {b} = {partial}\n{partial} {second} {c} = {result}\n#### {result}"


def _divide(rng: random.Random, top: int) -> Problem:
    share, people = rng.randint(1, top), rng.randint(2, top)
    total = share * people
    question = _words(rng, (
        "{x} shares {total} {obj} equally among {people} friends. How many {obj} does each friend get?",
        "{x} puts {total} {obj} into {people} boxes with the same number in each box. How many {obj} are in each box?",
    ), total=total, people=people)
    return question, f"{total} / {people} = {share}\n#### {share}"


ONE_STEP = (
    functools.partial(_one_step, op="+", templates=(
        "{x} has {a} {obj}. {y} gives {x} {b} more {obj}. How many {obj} does {x} have now?",
        "{x} picked {a} {obj} in the morning and {b} {obj} in the afternoon. How many {obj} did {x} pick in total?",
        "There are {a} {obj} in a box and {b} {obj} on the table. How many {obj} are there altogether?",
    )),
    functools.partial(_one_step, op="-", templates=(
        "{x} has {a} {obj} and gives {b} of them to {y}. How many {obj} does {x} have left?",
        "A shop had {a} {obj}. It sold {b} {obj}. How many {obj} does the shop have now?",
        "{x} had {a} {obj} and lost {b} of them. How many {obj} does {x} have now?",
    )),
    functools.partial(_one_step, op="*", templates=(
        "{x} buys {a} bags with {b} {obj} in each bag. How many {obj} does {x} buy?",
        "There are {a} rows of {obj} with {b} {obj} in each row. How many {obj} are there?",
    )),
    _divide,
)
TWO_STEP = (
    functools.partial(_two_step, first="+", second="-", template="{x} has {a} {obj}. {x} buys {b} more and then "
                      "gives {c} to {y}. How many {obj} does {x} have now?"),
    functools.partial(_two_step, first="*", second="+", template="{x} buys {a} packs of {obj} with {b} {obj} in "
                      "each pack and finds {c} more {obj}. How many {obj} does {x} have?"),
    functools.partial(_two_step, first="*", second="-", template="{x} has {a} boxes with {b} {obj} in each box. "
                      "{x} gives {c} {obj} to {y}. How many {obj} does {x} have left?"),
)


def in_val_pool(question: str) -> bool:
    """True if `question` belongs to the validation pool (a stable hash of its text)."""
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") % VAL_BUCKETS == 0


def draw_split(draw: Callable[[random.Random], tuple[str, dict[str, str], bool]], cfg: ArithmeticConfig | DigitsConfig,
               split: str, source: str, what: str, key: str) -> list[dict[str, str]]:
    """`cfg.train_size` or `cfg.val_size` rows of `split` from `draw(rng) -> (question, row, held_out)`:
    training rows drawn with `cfg.seed`, repeats allowed; validation rows with VAL_SEED, each question
    once. ValueError naming data.<source>.<key> after MAX_MISSES fruitless draws in a row."""
    want_val = split == "val"
    rng = random.Random(VAL_SEED if want_val else cfg.seed)
    size = cfg.val_size if want_val else cfg.train_size
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    misses = 0  # draws since the last accepted one
    while len(rows) < size and misses < MAX_MISSES:
        question, row, held_out = draw(rng)
        if held_out != want_val or (want_val and question in seen):
            misses += 1
        else:
            misses = 0
            seen.add(question)
            rows.append(row)
    if len(rows) < size:
        raise ValueError(f"data.{source}: found only {len(rows)} {what} of the {size} asked for; "
                         f"raise data.{source}.{key} or lower data.{source}.val_size")
    return rows


def generate_problems(cfg: ArithmeticConfig, split: str) -> list[dict[str, str]]:
    """Rows {"question", "answer"} of split "train" or "val" (`draw_split`)."""

    def draw(rng: random.Random) -> tuple[str, dict[str, str], bool]:
        family = TWO_STEP if rng.random() < cfg.two_step_fraction else ONE_STEP
        question, answer = rng.choice(family)(rng, cfg.max_operand)
        return question, {"question": question, "answer": answer}, in_val_pool(question)

    return draw_split(draw, cfg, split, "arithmetic", f"distinct {split} problems", "max_operand")
