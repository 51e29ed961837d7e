"""Digit tasks for the tiny model (`data.source=digits`): small proofs that PPO learns.

A question is the whole prompt, e.g. "3+4=" or "123="; with `data.prompt_template='{question}'`
and no chat template the tiny model's character tokenizer sees one token per character:

- `sum`: "a+b=" -> the sum of two digits, for the 55 pairs with a one-digit sum (a + b <= 9).
  The addition table is the task, so both splits hold every pair; validation is the whole table.
  Training draws the sum uniformly, then a pair with that sum: every answer is equally frequent.
  With pairs drawn uniformly the answer 9 is ten times as frequent as 0, and a policy whose
  output does not yet depend on the prompt (the tiny random model's, for its first ~20 steps)
  is pushed towards the frequent answers and away from the rare ones, which are then hardly
  ever sampled again (docs/learning.md).
- `reverse`: a string of digits -> the same digits in reverse order: "123=" -> "321".
  A random policy gets three digits right with probability ~1e-6, so training strings have
  `min_length`..`length` digits (the length drawn uniformly, then each digit): the one-digit
  strings are an echo a random policy hits with probability ~0.01, and the k-th answer digit is
  always the one 2k-1 positions before it, whatever the length, so what the short strings
  teach carries over to the long ones. Validation holds `val_size` distinct strings of `length`
  digits that training never shows (the hash split of the arithmetic generator): its accuracy
  measures the learned procedure, not memorised strings.

`score` is the tasks' reward (`reward.fn=ppo_trainer.data.digits:score`): 1 when the response
begins with the answer, all its digits right, else 0, on the last token only. What follows
the answer is ignored: a random policy ends its response (EOS) with probability ~0.01 per
token, so an exact match would hide nearly every right answer to a short string.
"""

from __future__ import annotations

import random

from ppo_trainer.config import DigitsConfig
from ppo_trainer.data.arithmetic import draw_split, in_val_pool

DIGITS = "0123456789"
SUM_PAIRS = tuple((a, b) for a in range(10) for b in range(10) if a + b <= 9)


def score(response: str, ground_truth: str) -> float:
    """1.0 if `response` starts with `ground_truth` (both stripped of surrounding space), else 0.0."""
    truth = ground_truth.strip()
    return 1.0 if truth and response.strip().startswith(truth) else 0.0


def generate_rows(cfg: DigitsConfig, split: str) -> list[dict[str, str]]:
    """Rows {"question", "answer"} of one split ("train": `cfg.train_size` rows drawn with
    `cfg.seed`; "val": see the module docstring, drawn with the fixed VAL_SEED).

    Raises ValueError if `cfg.task` is unknown or the held-out pool is too small for `cfg.val_size`.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if cfg.task == "sum":
        if split == "val":
            return [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in SUM_PAIRS]
        rng = random.Random(cfg.seed)
        rows = []
        for _ in range(cfg.train_size):
            total = rng.randint(0, 9)
            a = rng.randint(0, total)
            rows.append({"question": f"{a}+{total - a}=", "answer": str(total)})
        return rows
    if cfg.task == "reverse":
        return _reverse_rows(cfg, split)
    raise ValueError(f"data.digits.task={cfg.task!r} is unknown; use 'sum' or 'reverse'")


def _reverse_rows(cfg: DigitsConfig, split: str) -> list[dict[str, str]]:
    want_val = split == "val"
    size = cfg.val_size if want_val else cfg.train_size

    def draw(rng: random.Random) -> tuple[str, dict[str, str], bool]:
        length = cfg.length if want_val else rng.randint(cfg.min_length, cfg.length)
        digits = "".join(rng.choice(DIGITS) for _ in range(length))
        # only strings of `length` digits are held out; every shorter one is training data
        held_out = length == cfg.length and in_val_pool(digits)
        return digits, {"question": f"{digits}=", "answer": digits[::-1]}, held_out

    rows = draw_split(draw, want_val, cfg.seed, size)
    if len(rows) < size:
        raise ValueError(
            f"data.digits: found only {len(rows)} distinct held-out strings of {cfg.length} digits of the "
            f"{size} asked for; raise data.digits.length or lower data.digits.val_size"
        )
    return rows
