"""A seeded generator of easy GSM8K-format word problems ("#### N") that a 135M model can learn:
one or two operations on whole numbers from 1 to `max_operand`, with non-negative integer answers.

Train and validation never share a question (a hash of its text picks the validation pool). The
validation sets are frozen: each is drawn with its own fixed seed from its own keys, whatever the
training draws, so it is comparable across runs.

| data_source       | rows            | operations; share of two-step ones      | numbers up to      | seed            |
|-------------------|-----------------|-----------------------------------------|--------------------|-----------------|
| `arithmetic`      | `train_size`    | `operations`; `two_step_fraction`       | `max_operand`      | `seed`          |
| `arithmetic`      | `val_size`      | all four; `val_two_step_fraction`       | `val_max_operand`  | `VAL_SEED`      |
| `arithmetic/hard` | `hard_val_size` | the two-step forms only                 | `hard_max_operand` | `HARD_VAL_SEED` |

A null val_* key takes the training key's value; the defaults draw the problems of earlier
versions, problem for problem.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import random
from typing import Callable, Sequence

from ppo_trainer.config.schema import ARITHMETIC_OPERATIONS, ArithmeticConfig, DigitsConfig

SOURCE = "arithmetic"  # the data_source of training rows and of the one-step validation set
HARD_SOURCE = "arithmetic/hard"  # the data_source of the harder validation set
VAL_SEED = 1_000_003
HARD_VAL_SEED = 2_000_003
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


ONE_STEP = {  # by operation (ARITHMETIC_OPERATIONS, in that order: draws depend on it)
    "+": functools.partial(_one_step, op="+", templates=(
        "{x} has {a} {obj}. {y} gives {x} {b} more {obj}. How many {obj} does {x} have now?",
        "{x} picked {a} {obj} in the morning and {b} {obj} in the afternoon. How many {obj} did {x} pick in total?",
        "There are {a} {obj} in a box and {b} {obj} on the table. How many {obj} are there altogether?",
    )),
    "-": functools.partial(_one_step, op="-", templates=(
        "{x} has {a} {obj} and gives {b} of them to {y}. How many {obj} does {x} have left?",
        "A shop had {a} {obj}. It sold {b} {obj}. How many {obj} does the shop have now?",
        "{x} had {a} {obj} and lost {b} of them. How many {obj} does {x} have now?",
    )),
    "*": functools.partial(_one_step, op="*", templates=(
        "{x} buys {a} bags with {b} {obj} in each bag. How many {obj} does {x} buy?",
        "There are {a} rows of {obj} with {b} {obj} in each row. How many {obj} are there?",
    )),
    "/": _divide,
}
TWO_STEP = {  # by first and second operation (ARITHMETIC_TWO_STEP, in that order)
    "+-": functools.partial(_two_step, first="+", second="-", template="{x} has {a} {obj}. {x} buys {b} more and then "
                            "gives {c} to {y}. How many {obj} does {x} have now?"),
    "*+": functools.partial(_two_step, first="*", second="+", template="{x} buys {a} packs of {obj} with {b} {obj} in "
                            "each pack and finds {c} more {obj}. How many {obj} does {x} have?"),
    "*-": functools.partial(_two_step, first="*", second="-", template="{x} has {a} boxes with {b} {obj} in each box. "
                            "{x} gives {c} {obj} to {y}. How many {obj} does {x} have left?"),
}
Form = Callable[[random.Random, int], Problem]  # (rng, largest number) -> a problem


def forms(operations: Sequence[str]) -> tuple[tuple[Form, ...], tuple[Form, ...]]:
    """The one-step and the two-step problem forms that use only `operations`, in the generator's order."""
    return (tuple(form for op, form in ONE_STEP.items() if op in operations),
            tuple(form for ops, form in TWO_STEP.items() if all(op in operations for op in ops)))


def in_val_pool(question: str) -> bool:
    """True if `question` belongs to the validation pool (a stable hash of its text)."""
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") % VAL_BUCKETS == 0


def draw_split(draw: Callable[[random.Random], tuple[str, dict[str, str], bool]], cfg: ArithmeticConfig | DigitsConfig,
               split: str, source: str, what: str, key: str) -> list[dict[str, str]]:
    """`cfg.train_size` or `cfg.val_size` rows of `split` from `draw(rng) -> (question, row, held_out)`:
    training rows drawn with `cfg.seed`, validation rows with VAL_SEED (`draw_rows`); the error names
    data.<source>.<key>."""
    want_val = split == "val"
    seed, size = (VAL_SEED, cfg.val_size) if want_val else (cfg.seed, cfg.train_size)
    return draw_rows(draw, seed, size, want_val, f"data.{source}", what,
                     f"raise data.{source}.{key} or lower data.{source}.val_size")


def draw_rows(draw: Callable[[random.Random], tuple[str, dict[str, str], bool]], seed: int, size: int,
              held_out: bool, where: str, what: str, fix: str) -> list[dict[str, str]]:
    """`size` rows from `draw(rng) -> (question, row, in the validation pool)` with `random.Random(seed)`:
    training rows (not `held_out`) from outside the pool, repeats allowed; validation rows from inside
    it, each question once. ValueError "<where>: found only N <what> ...; <fix>" after MAX_MISSES
    fruitless draws in a row (the pool is smaller than `size`)."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    misses = 0  # draws since the last accepted one
    while len(rows) < size and misses < MAX_MISSES:
        question, row, in_pool = draw(rng)
        if in_pool != held_out or (held_out and question in seen):
            misses += 1
        else:
            misses = 0
            seen.add(question)
            rows.append(row)
    if len(rows) < size:
        raise ValueError(f"{where}: found only {len(rows)} {what} of the {size} asked for; {fix}")
    return rows


def shape(cfg: ArithmeticConfig, split: str) -> tuple[int, float, Sequence[str]]:
    """(largest number, share of two-step problems, operations) of split "train" (`cfg.max_operand`,
    `two_step_fraction`, `operations`) or "val" (`val_max_operand`, `val_two_step_fraction`, where
    null the training's, and every operation)."""
    if split == "train":
        return cfg.max_operand, cfg.two_step_fraction, cfg.operations
    top = cfg.max_operand if cfg.val_max_operand is None else cfg.val_max_operand
    fraction = cfg.two_step_fraction if cfg.val_two_step_fraction is None else cfg.val_two_step_fraction
    return top, fraction, ARITHMETIC_OPERATIONS


def generate_problems(cfg: ArithmeticConfig, split: str) -> list[dict[str, str]]:
    """Rows {"question", "answer"} of split "train" or "val" (SOURCE's validation set; the hard one is
    `generate_hard_problems`'s) as `shape` says, drawn by `draw_split`."""
    top, fraction, operations = shape(cfg, split)
    one_step, two_step = forms(operations)

    def draw(rng: random.Random) -> tuple[str, dict[str, str], bool]:
        family = two_step if rng.random() < fraction else one_step
        question, answer = rng.choice(family)(rng, top)
        return question, {"question": question, "answer": answer}, in_val_pool(question)

    key = "max_operand" if split == "train" or cfg.val_max_operand is None else "val_max_operand"
    return draw_split(draw, cfg, split, SOURCE, f"distinct {split} problems", key)


def generate_hard_problems(cfg: ArithmeticConfig) -> list[dict[str, str]]:
    """The harder frozen validation set: `cfg.hard_val_size` distinct problems of two operations
    (every two-step form) with numbers up to `cfg.hard_max_operand`, drawn with HARD_VAL_SEED from the
    validation pool. No other key changes it, and training never draws its questions."""
    _, two_step = forms(ARITHMETIC_OPERATIONS)

    def draw(rng: random.Random) -> tuple[str, dict[str, str], bool]:
        question, answer = rng.choice(two_step)(rng, cfg.hard_max_operand)
        return question, {"question": question, "answer": answer}, in_val_pool(question)

    return draw_rows(draw, HARD_VAL_SEED, cfg.hard_val_size, True, f"data.{SOURCE}",
                     "distinct hard validation problems",
                     f"raise data.{SOURCE}.hard_max_operand or lower data.{SOURCE}.hard_val_size")


def generate_sources(cfg: ArithmeticConfig, split: str) -> dict[str, list[dict[str, str]]]:
    """The rows of `split` by data_source: SOURCE's (`generate_problems`) and, for "val" with
    `cfg.hard_val_size` > 0, HARD_SOURCE's (`generate_hard_problems`)."""
    sources = {SOURCE: generate_problems(cfg, split)}
    if split == "val" and cfg.hard_val_size > 0:
        sources[HARD_SOURCE] = generate_hard_problems(cfg)
    return sources


def describe(cfg: ArithmeticConfig, split: str) -> str:
    """What `generate_sources` draws for `split`, for the dry run's plan: each set's size, number of
    operations and largest number (training's operations too)."""
    top, fraction, operations = shape(cfg, split)
    if split == "train":
        return f"{cfg.train_size} problems of {' '.join(operations)}, {_steps(fraction)}, numbers up to {top}"
    sets = [f"{SOURCE} ({cfg.val_size} problems, {_steps(fraction)}, numbers up to {top})"]
    if cfg.hard_val_size > 0:
        sets.append(f"{HARD_SOURCE} ({cfg.hard_val_size} problems, {_steps(1.0)}, numbers up to "
                    f"{cfg.hard_max_operand})")
    return " and ".join(sets)


def _steps(two_step_fraction: float) -> str:
    """"one operation each", "two operations each" or "N% with two operations"."""
    if two_step_fraction in (0.0, 1.0):
        return f"{'two operations' if two_step_fraction else 'one operation'} each"
    return f"{two_step_fraction:.0%} with two operations"
