"""Preference pairs read, checked and tokenized into `PairRecord`s. The layouts (docs/reward-models.md):
- a `prompt` (text or chat messages) with `chosen` and `rejected` responses as text (OpenRLHF, TRL);
- `chosen` and `rejected` as chat messages ending in the assistant's turn, with or without a prompt
  (TRL's conversational layout; Anthropic's HH-RLHF converted);
- `chosen` and `rejected` as text with the prompt inside them (HH-RLHF's "\\n\\nHuman: ... \\n\\nAssistant: ...").
Each side becomes the reward model's tokens exactly as `RewardModelEngine` renders a PPO response
(`conversation_ids`, or `plain_ids` for text that holds its own prompt), so the trained model scores
in PPO what it learned to score. Files and hub splits are read as the PPO prompts are
(`data.datasets.read_split`), malformed rows handled by data.bad_rows."""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ppo_trainer.data.datasets import DataError, MissingKey, RowSource, check_prompt, lookup, read_split
from ppo_trainer.engine.reward_model import conversation_ids, plain_ids

log = logging.getLogger("ppo_trainer")

Messages = list[dict[str, str]]
DEFAULT_PROMPT_KEY = "prompt"  # taken where data.prompt_key is null and the first row has it


@dataclass(frozen=True)
class PairRecord:
    """One preference pair as the reward model sees it."""

    chosen_ids: tuple[int, ...]  # the preferred conversation's tokens
    rejected_ids: tuple[int, ...]  # the other one's
    margin: float  # what chosen's score must beat rejected's by (0.0 without data.margin_key)
    data_source: str  # the row's data.source_key, else the file stem or hub dataset name
    where: str  # "path:line", "path row N", "name[split] row N"
    origin: str  # the file or hub split the row came from


Side = tuple[Optional[Messages], str]  # (the turns before the response, the response), or (None, a whole text)


def load_pairs(cfg: Any, tokenizer: Any, split: str) -> list[PairRecord]:
    """The pairs of `split` ("train" or "val") of the `data` section `cfg`, source after source;
    DataError (one line naming the key, file or row) when they cannot be loaded."""
    return [pair for source in read_split(cfg, split) for pair in load_source(source, cfg, tokenizer, split)]


def load_source(source: RowSource, cfg: Any, tokenizer: Any, split: str) -> list[PairRecord]:
    """The pairs of one file or hub split: rows parsed (malformed ones per data.bad_rows), tokenized,
    pairs with a side longer than data.max_length per data.overlong_pairs (counted per data_source)."""
    prompt_key = cfg.prompt_key or prompt_key_of(source)
    pairs: list[PairRecord] = []
    skipped: list[str] = []
    dropped: Counter[str] = Counter()
    for row in source.rows:
        try:
            if row.error is not None:
                raise ValueError(row.error)
            chosen, rejected, margin, data_source = parse_pair(row.value, cfg, prompt_key, source.default_source)
            chosen_ids, rejected_ids = side_ids(tokenizer, chosen), side_ids(tokenizer, rejected)
            if chosen_ids == rejected_ids:
                raise ValueError(f"'{cfg.chosen_key}' and '{cfg.rejected_key}' are identical: the pair prefers nothing")
        except ValueError as e:
            if cfg.bad_rows != "skip":
                raise DataError(f"{row.where}: {e}; fix the row or set data.bad_rows=skip to skip malformed rows") from None
            skipped.append(f"{row.where}: {e}")
            continue
        if max(len(chosen_ids), len(rejected_ids)) > cfg.max_length:
            if cfg.overlong_pairs == "error":
                raise DataError(f"{row.where}: a side is {max(len(chosen_ids), len(rejected_ids))} tokens, longer than "
                                f"data.max_length={cfg.max_length}; raise data.max_length, or set "
                                "data.overlong_pairs=drop to drop such pairs")
            dropped[data_source] += 1
            continue
        pairs.append(PairRecord(tuple(chosen_ids), tuple(rejected_ids), margin, data_source, row.where, source.origin))
    if skipped:
        log.warning("data: skipped %d malformed %s rows of %s (data.bad_rows=skip); the first: %s", len(skipped), split,
                    source.origin, skipped[0])
    for name, count in dropped.items():
        log.info("data: dropped %d %s pairs of data_source %s with a side longer than data.max_length=%d tokens",
                 count, split, name, cfg.max_length)
    if not pairs:
        raise DataError(f"{source.origin}: no {split} pairs left ({len(source.rows)} rows read, {len(skipped)} malformed "
                        f"and skipped, {sum(dropped.values())} longer than data.max_length={cfg.max_length})")
    log.info("data: %d %s pairs from %s", len(pairs), split, source.origin)
    return pairs


def prompt_key_of(source: RowSource) -> Optional[str]:
    """"prompt" where the source's first object row has it, else None (the prompt is inside the sides)."""
    first = next((row.value for row in source.rows if isinstance(row.value, dict)), None)
    return DEFAULT_PROMPT_KEY if first is not None and DEFAULT_PROMPT_KEY in first else None


def parse_pair(row: Any, cfg: Any, prompt_key: Optional[str], default_source: str) -> tuple[Side, Side, float, str]:
    """(chosen, rejected, margin, data_source) of one row; ValueError says what is wrong with it."""
    if not isinstance(row, dict):
        raise ValueError(f"expected an object with '{cfg.chosen_key}' and '{cfg.rejected_key}', got {type(row).__name__}")
    prompt = None if prompt_key is None else check_prompt(lookup(row, prompt_key), prompt_key)
    chosen = parse_side(lookup(row, cfg.chosen_key), cfg.chosen_key, prompt)
    rejected = parse_side(lookup(row, cfg.rejected_key), cfg.rejected_key, prompt)
    margin = 0.0
    if cfg.margin_key is not None:
        value = lookup(row, cfg.margin_key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"'{cfg.margin_key}' (data.margin_key) must be a finite number, got {value!r:.40}")
        margin = float(value)
    try:
        source = lookup(row, cfg.source_key)
    except MissingKey:
        source = None
    if source is not None and (not isinstance(source, str) or not source.strip()):
        raise ValueError(f"'{cfg.source_key}' (data.source_key) must be a non-empty string, got {source!r:.40}")
    return chosen, rejected, margin, source or default_source


def parse_side(value: Any, key: str, prompt: Optional[str | Messages]) -> Side:
    """One response: text after the prompt, or chat messages ending in the assistant's turn (after
    the prompt's turns, where there is a prompt); text without a prompt holds its own (HH-RLHF)."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"'{key}' is an empty string")
        return (turns, value) if prompt is not None else (None, value)
    if not isinstance(value, list) or not value:
        raise ValueError(f"'{key}' must be text or a non-empty list of chat messages, got {type(value).__name__} "
                         f"{value!r:.40}")
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"'{key}' message {i} must be an object with a string 'role' and 'content', got "
                             f"{message!r:.60}")
    if value[-1]["role"] != "assistant":
        raise ValueError(f"'{key}' must end with the assistant's turn (the response it judges), ends with "
                         f"{value[-1]['role']!r}")
    before = turns + [{"role": m["role"], "content": m["content"]} for m in value[:-1]]
    if not any(m["role"] == "user" for m in before):
        raise ValueError(f"'{key}' has no user turn before its response, and the row no prompt")
    return before, value[-1]["content"]


def side_ids(tokenizer: Any, side: Side) -> list[int]:
    """The reward model's tokens of one side (`conversation_ids`, or `plain_ids` for a whole text)."""
    messages, text = side
    return plain_ids(tokenizer, text) if messages is None else conversation_ids(tokenizer, messages, text)


def pair_sources(pairs: Sequence[PairRecord]) -> list[str]:
    """The data_sources of `pairs`, in order of first appearance."""
    return list(dict.fromkeys(p.data_source for p in pairs))
