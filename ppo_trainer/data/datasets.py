"""Prompt datasets (a hub dataset, local jsonl/parquet files, or a built-in generator) rendered,
tokenized and filtered into `PromptRecord`s; malformed rows are named by file and line."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from ppo_trainer.config import DataConfig
from ppo_trainer.data import arithmetic, digits
from ppo_trainer.models.loading import hub_offline
from ppo_trainer.rewards.math import ANSWER_MARKER

logger = logging.getLogger("ppo_trainer")

GENERATED = ("arithmetic", "digits")  # built-in generators: their rows have "question" and "answer"
FILES_HINT = "data.source=files data.train_files=[train.jsonl] data.val_files=[test.jsonl]"


class DataError(ValueError):
    """The data cannot be loaded as configured; the one-line message names the key, file or row."""


@dataclass(frozen=True)
class PromptRecord:
    index: int  # the row's position in its source split (0-based; malformed rows keep their number)
    question: str
    prompt: str  # the text the model continues (chat template applied, assistant turn opened)
    prompt_ids: tuple[int, ...]  # the token ids of `prompt`, length <= data.max_prompt_length
    ground_truth: str  # the final answer, commas stripped


@dataclass(frozen=True)
class RawRow:
    """A row as read from its source; `error` says why it could not even be parsed."""

    where: str  # "path:line" for jsonl, "path row N" for parquet, "name[split] row N" for the hub
    value: Any = None
    error: str | None = None


def load_prompts(cfg: DataConfig, tokenizer: Any, split: str) -> list[PromptRecord]:
    """The prompts of `split` ("train" or "val"); DataError (one line) when they cannot be loaded."""
    if cfg.use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError("data.use_chat_template=true, but the model's tokenizer has no chat template; "
                        "set data.use_chat_template=false")
    source, rows = read_rows(cfg, split)
    keys = ("question", "answer") if cfg.source in GENERATED else (cfg.prompt_key, cfg.answer_key)
    examples, skipped = parse_rows(rows, keys, cfg.bad_rows)
    if skipped:
        logger.warning("data: skipped %d malformed %s rows of %s (data.bad_rows=skip); the first: %s",
                       len(skipped), split, source, skipped[0])
    records, too_long = build_records(examples, cfg, tokenizer)
    if too_long:
        logger.info("data: dropped %d of %d %s prompts longer than data.max_prompt_length=%d tokens",
                    too_long, len(examples), split, cfg.max_prompt_length)
    if not records:
        raise DataError(f"{source}: no {split} prompts left ({len(examples) + len(skipped)} rows read, {len(skipped)} "
                        f"malformed and skipped, {too_long} longer than data.max_prompt_length={cfg.max_prompt_length} "
                        "tokens); check the data or raise data.max_prompt_length")
    logger.info("data: %d %s prompts from %s", len(records), split, source)
    return records


def read_rows(cfg: DataConfig, split: str) -> tuple[str, Iterator[RawRow]]:
    """(a description of the source, its rows) for `split` of `cfg.source`."""
    if cfg.source in GENERATED:
        generate = arithmetic.generate_problems if cfg.source == "arithmetic" else digits.generate_rows
        try:
            problems = generate(getattr(cfg, cfg.source), split)
        except ValueError as e:
            raise DataError(str(e)) from None
        what = f"{cfg.digits.task}, {split}" if cfg.source == "digits" else split
        return f"the {cfg.source} generator ({what})", (RawRow(f"{cfg.source}[{split}] row {i}", row)
                                                        for i, row in enumerate(problems))
    if cfg.source == "files":
        key = f"data.{split}_files"
        paths = [Path(p) for p in (cfg.train_files if split == "train" else cfg.val_files)]
        if not paths:
            raise DataError(f"{key} is empty; data.source=files needs jsonl or parquet files: {FILES_HINT}")
        for path in paths:
            if not path.is_file():
                raise DataError(f"{key}: file not found: {path}")
            if path.suffix not in (".jsonl", ".parquet"):
                raise DataError(f"{key}: {path} is neither .jsonl nor .parquet; convert it to one of them")
        return ", ".join(map(str, paths)), (row for path in paths for row in read_file(path))
    hub_split = cfg.train_split if split == "train" else cfg.val_split
    return f"{cfg.source}[{hub_split}]", read_hub(cfg.source, cfg.hub_config, hub_split)


def read_file(path: Path) -> Iterator[RawRow]:
    """Rows of a .parquet or .jsonl file (blank lines ignored, a line that is not JSON an error row)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield RawRow(f"{path} row {i}", row)
        return
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                yield RawRow(where, json.loads(line))
            except json.JSONDecodeError as e:
                yield RawRow(where, error=f"invalid JSON ({e.msg} at column {e.colno})")


def read_hub(name: str, config: str | None, split: str) -> Iterator[RawRow]:
    """Rows of a hub dataset split through `datasets.load_dataset` (its local cache when offline)."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        reason = ("is not in the local Hugging Face cache and the hub is offline" if hub_offline(datasets=True)
                  else f"could not be loaded ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})")
        raise DataError(f"data.source={name} (config {config}, split {split}) {reason}; pass local files: {FILES_HINT}") from e
    return (RawRow(f"{name}[{split}] row {i}", row) for i, row in enumerate(dataset))


def parse_row(row: Any, prompt_key: str, answer_key: str) -> tuple[str, str]:
    """(question, ground truth) of one row; ValueError says what is wrong with it."""
    if not isinstance(row, dict):
        raise ValueError(f"expected an object with '{prompt_key}' and '{answer_key}', got {type(row).__name__}")
    for key in (prompt_key, answer_key):
        if key not in row:
            raise ValueError(f"missing key '{key}' (row has: {', '.join(map(str, row)) or 'no keys'})")
    question, answer = row[prompt_key], row[answer_key]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"'{prompt_key}' must be a non-empty string, got {type(question).__name__} {question!r:.40}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"'{answer_key}' must be a string or a number, got {type(answer).__name__}")
    try:
        return question, ground_truth(str(answer))
    except ValueError as e:
        raise ValueError(f"'{answer_key}': {e}") from None


def parse_rows(rows: Iterator[RawRow], keys: tuple[str, str],
               bad_rows: str) -> tuple[list[tuple[int, str, str]], list[str]]:
    """([(row index, question, ground truth)], ["where: reason" of each malformed row skipped])."""
    examples: list[tuple[int, str, str]] = []
    skipped: list[str] = []
    for index, row in enumerate(rows):
        try:
            if row.error is not None:
                raise ValueError(row.error)
            question, truth = parse_row(row.value, *keys)
        except ValueError as e:
            if bad_rows != "skip":
                raise DataError(f"{row.where}: {e}; fix the row or set data.bad_rows=skip to skip malformed rows") from None
            skipped.append(f"{row.where}: {e}")
            continue
        examples.append((index, question, truth))
    return examples, skipped


def build_records(examples: list[tuple[int, str, str]], cfg: DataConfig,
                  tokenizer: Any) -> tuple[list[PromptRecord], int]:
    """(records that fit in `cfg.max_prompt_length` tokens, number of prompts dropped as too long)."""
    try:
        prompts = [format_prompt(user_message(question, cfg.prompt_template, cfg.instruction), tokenizer,
                                 cfg.use_chat_template, cfg.system_prompt) for _, question, _ in examples]
    except ValueError as e:
        raise DataError(str(e)) from None
    ids = tokenizer(prompts, add_special_tokens=not cfg.use_chat_template)["input_ids"] if prompts else []
    records = [PromptRecord(index, question, prompt, tuple(prompt_ids), truth)
               for (index, question, truth), prompt, prompt_ids in zip(examples, prompts, ids)
               if len(prompt_ids) <= cfg.max_prompt_length]
    return records, len(examples) - len(records)


def ground_truth(answer: str) -> str:
    """The text after the last "####", commas and surrounding space stripped; an answer without the
    marker is taken whole (an answer column of bare numbers). ValueError if nothing is left."""
    truth = answer.rpartition(ANSWER_MARKER)[2].replace(",", "").strip()
    if not truth:
        raise ValueError(f"answer has nothing after '{ANSWER_MARKER}'")
    return truth


def user_message(question: str, template: str, instruction: str) -> str:
    """The user turn: `template` with {question} and {instruction} filled in; ValueError naming
    `data.prompt_template` if it has another placeholder."""
    try:
        return template.format(question=question.strip(), instruction=instruction)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"data.prompt_template={template!r} cannot be filled ({type(e).__name__}: {e}); it may use "
                         "only {question} and {instruction} (write literal braces as {{ }})") from None


def format_prompt(message: str, tokenizer: Any, use_chat_template: bool, system_prompt: Optional[str] = None) -> str:
    """The text the model continues: the chat template, assistant turn opened (a system turn of
    `system_prompt` unless None: the template's default), or the bare message."""
    if not use_chat_template:
        return message
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    return tokenizer.apply_chat_template([*system, {"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
