"""Digit tasks for the tiny model (`data.source=digits`): small proofs that PPO learns
(docs/learning.md); their reward is `ppo_trainer.rewards.digits:score`.

A question is the whole prompt ("3+4=", "123="): with `data.prompt_template='{question}'` and no
chat template the tiny model's character tokenizer sees one token per character.

- `sum`: "a+b=" -> a + b, for the 55 pairs with a + b <= 9; validation is the whole table.
  Training draws the sum uniformly, then a pair with that sum. With pairs drawn uniformly the
  answer 9 is ten times as frequent as 0, and a policy whose output does not yet depend on the
  prompt (the tiny random model's, for its first ~20 steps) is pushed away from the rare
  answers, which are then hardly ever sampled again.
- `reverse`: "123=" -> "321". A random policy gets three digits right with probability ~1e-6, so
  training strings have `min_length`..`length` digits (the length drawn uniformly): one digit is
  an echo a random policy hits with probability ~0.01, and the k-th answer digit is always the
  one 2k-1 positions before it, so what the short strings teach carries over to the long ones.
  Validation holds `val_size` distinct strings of `length` digits that training never shows (the
  arithmetic generator's hash split): it measures the learned procedure, not memorised strings.
"""

from __future__ import annotations

import random

from ppo_trainer.config import DigitsConfig
from ppo_trainer.data.arithmetic import draw_split, in_val_pool

SUM_PAIRS = tuple((a, b) for a in range(10) for b in range(10) if a + b <= 9)


def generate_rows(cfg: DigitsConfig, split: str) -> list[dict[str, str]]:
    """Rows {"question", "answer"} of split "train" (`cfg.train_size` rows drawn with `cfg.seed`)
    or "val" (drawn with the fixed VAL_SEED). Raises ValueError for an unknown `cfg.task`."""
    want_val = split == "val"
    if cfg.task == "sum":
        if want_val:
            return [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in SUM_PAIRS]
        rng = random.Random(cfg.seed)
        rows = []
        for _ in range(cfg.train_size):
            total = rng.randint(0, 9)
            a = rng.randint(0, total)
            rows.append({"question": f"{a}+{total - a}=", "answer": str(total)})
        return rows
    if cfg.task != "reverse":
        raise ValueError(f"data.digits.task={cfg.task!r} is unknown; use 'sum' or 'reverse'")

    def draw(rng: random.Random) -> tuple[str, dict[str, str], bool]:
        length = cfg.length if want_val else rng.randint(cfg.min_length, cfg.length)
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        # only strings of `length` digits are held out; every shorter one is training data
        held_out = length == cfg.length and in_val_pool(digits)
        return digits, {"question": f"{digits}=", "answer": digits[::-1]}, held_out

    return draw_split(draw, want_val, cfg.seed, cfg.val_size if want_val else cfg.train_size, "digits",
                      f"distinct held-out strings of {cfg.length} digits", "length")
