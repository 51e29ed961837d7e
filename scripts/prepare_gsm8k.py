"""GSM8K jsonl files (rows {"question", "answer"}, as GSM8K's repository and the hub's openai/gsm8k
ship them) -> parquet in verl's layout, one file per input, named after it:

    python scripts/prepare_gsm8k.py train.jsonl test.jsonl --out data/gsm8k
    ppo-train +experiment=gsm8k data.train_files=data/gsm8k/train.parquet data.val_files=data/gsm8k/test.parquet

A row: data_source "openai/gsm8k"; prompt [{"role": "user", "content": the question and the
recipe's instruction, as its data.prompt_template writes them}]; ability "math"; reward_model
{"style": "rule", "ground_truth": the final answer, thousands separators dropped ("1600")};
extra_info {"split": the input's stem, "index", "answer": the full solution, "question"}. The
trainer reads these files with its default keys; verl reads them too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DATA_SOURCE = "openai/gsm8k"


def verl_rows(path: Path, prompt_template: str, instruction: str) -> list[dict[str, Any]]:
    """The rows of one GSM8K jsonl file in verl's layout; DataError naming the file and line of a
    malformed row."""
    from ppo_trainer.data.datasets import PLAIN_KEYS, DataError, parse_row, read_file, user_message
    from ppo_trainer.rewards.math import truth_answers

    rows = []
    for index, raw in enumerate(read_file(path)):
        try:
            if raw.error is not None:
                raise ValueError(raw.error)
            parsed = parse_row(raw.value, PLAIN_KEYS, "data_source", DATA_SOURCE)
            if not isinstance(parsed.prompt, str):
                raise ValueError("'question' must be a string in a GSM8K file")
            truth = truth_answers(parsed.ground_truth)[0]
        except ValueError as e:
            raise DataError(f"{raw.where}: {e}") from None
        content = user_message(parsed.prompt, prompt_template, instruction)
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": content}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": truth},
                     "extra_info": {"split": path.stem, "index": index, "answer": parsed.ground_truth,
                                    "question": parsed.prompt}})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="prepare_gsm8k.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, metavar="FILE.jsonl", help="GSM8K jsonl files")
    parser.add_argument("--out", type=Path, required=True, help="folder for FILE.parquet")
    parser.add_argument("--experiment", default="gsm8k",
                        help="the recipe whose data.prompt_template and data.instruction shape the user turn")
    args = parser.parse_args(argv)

    import pyarrow as pa
    import pyarrow.parquet as pq

    from ppo_trainer.config.composition import compose
    from ppo_trainer.data.datasets import DataError

    data = compose([f"+experiment={args.experiment}"]).data
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.inputs:
        if not path.is_file():
            sys.exit(f"prepare_gsm8k: no such file: {path}")
        try:
            rows = verl_rows(path, data.prompt_template, data.instruction)
        except DataError as e:
            sys.exit(f"prepare_gsm8k: {e}")
        out = args.out / f"{path.stem}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), out)
        print(f"{path}: {len(rows)} rows -> {out}")


if __name__ == "__main__":
    main()
