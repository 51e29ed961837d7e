"""Digit tasks for the tiny model (`data.source=digits`, reward `ppo_trainer.rewards.digits:score`):
small proofs that PPO learns (docs/learning.md). A question is the whole prompt ("3+4=", "123=").

- `sum`: "a+b=" -> a + b for the 55 pairs with a + b <= 9; validation is the whole table. Training
  draws the sum uniformly, then the pair: with uniform pairs the answer 9 is ten times as frequent
  as 0, and a policy that ignores the prompt is pushed away from the rare answers for good.
- `reverse`: "123=" -> "321". Training strings have `min_length`..`length` digits: a random policy
  echoes one digit with probability ~0.01 (three: ~1e-6), and the short strings teach the long
  ones. Validation holds distinct strings of `length` digits that training never shows.
- `reveal`: "123?" -> a digit drawn apart from the prompt's `length` noise digits, so no single turn
  finds it more often than a guess (1 in 10); the environment `agents.tasks.RevealDigit` shows it
  after a wrong first guess ("no:7="), and the second turn can copy it: multi-turn (docs/multi-turn.md).
  Validation: distinct noise strings training never shows.
"""

from __future__ import annotations

import random

from ppo_trainer.config.schema import DigitsConfig
from ppo_trainer.data.arithmetic import draw_split, in_val_pool

SUM_PAIRS = tuple((a, b) for a in range(10) for b in range(10) if a + b <= 9)


def generate_rows(cfg: DigitsConfig, split: str) -> list[dict[str, str]]:
    """Rows {"question", "answer"} of split "train" or "val" of `cfg.task`."""
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

    if cfg.task == "reveal":
        def draw_hidden(rng: random.Random) -> tuple[str, dict[str, str], bool]:
            question = "".join(rng.choice("0123456789") for _ in range(cfg.length)) + "?"
            return question, {"question": question, "answer": rng.choice("0123456789")}, in_val_pool(question)

        return draw_split(draw_hidden, cfg, split, "digits", f"distinct noise strings of {cfg.length} digits",
                          "length")

    def draw(rng: random.Random) -> tuple[str, dict[str, str], bool]:
        length = cfg.length if want_val else rng.randint(cfg.min_length, cfg.length)
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        # only strings of `length` digits are held out; every shorter one is training data
        held_out = length == cfg.length and in_val_pool(digits)
        return digits, {"question": f"{digits}=", "answer": digits[::-1]}, held_out

    return draw_split(draw, cfg, split, "digits", f"distinct held-out strings of {cfg.length} digits", "length")
