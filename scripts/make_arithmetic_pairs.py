"""Preference pairs from the built-in arithmetic problems, judged by the rule reward, for ppo-train-rm.

    python scripts/make_arithmetic_pairs.py --out data/arith_pairs      # train.jsonl and val.jsonl there
    ppo-train-rm +rm_experiment=arithmetic                             # the reward model from them

Each row: the prompt as ppo-train +experiment=rlhf_cpu shows it to the reward model (its system and
user turns: the gsm8k_cpu recipe's instruction), the generator's worked answer ("3 + 4 = 7\n#### 7")
as chosen, and as rejected the same work ending in a wrong number, or without its "#### N" line. The rule reward
(`ppo_trainer.rewards.math.score`, strict, format_score 0.1) scores chosen 1 and rejected 0.1 or 0;
every pair is checked to be ordered by it. Validation pairs come from the generator's held-out
problems (data_source `wrong_number` or `no_format` says which kind of rejection). Offline, seconds.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from ppo_trainer.config.schema import ArithmeticConfig
from ppo_trainer.data.arithmetic import generate_problems
from ppo_trainer.rewards.math import score

INSTRUCTION = 'Show the calculation, then write "####" and the final number.'  # configs/experiment/gsm8k_cpu.yaml


def pair(question: str, worked: str, rng: random.Random) -> dict:
    """One row: the generator's worked answer ("3 + 4 = 7\n#### 7") chosen; rejected the same work
    ending in a wrong final number, or without its "#### N" line (only correctness or format differ)."""
    work, _, number = worked.rpartition("####")
    if rng.random() < 0.5:
        wrong = str(int(number) + rng.choice([-3, -2, -1, 1, 2, 3]))
        rejected, kind = f"{work}#### {wrong}", "wrong_number"
    else:
        rejected, kind = work.rstrip(), "no_format"
    if not score(worked, worked, format_score=0.1) > score(rejected, worked, format_score=0.1):
        raise AssertionError(f"the rule does not prefer {worked!r} over {rejected!r} for {question!r}")
    prompt = [{"role": "system", "content": ""}, {"role": "user", "content": f"{question} {INSTRUCTION}"}]
    return {"prompt": prompt, "chosen": worked, "rejected": rejected, "data_source": kind}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/arith_pairs"))
    parser.add_argument("--train", type=int, default=2000, help="training pairs")
    parser.add_argument("--val", type=int, default=256, help="held-out pairs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = ArithmeticConfig(train_size=args.train, val_size=args.val, seed=args.seed)
    for split, name in (("train", "train.jsonl"), ("val", "val.jsonl")):
        rows = [pair(p["question"], p["answer"], rng) for p in generate_problems(cfg, split)]
        (args.out / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{args.out / name}: {len(rows)} pairs")


if __name__ == "__main__":
    main()
