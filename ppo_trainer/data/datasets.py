"""Prompt datasets (a hub dataset, local jsonl/parquet files, or a built-in generator) parsed,
rendered with the chat template, tokenized and filtered into `PromptRecord`s; malformed rows are
named by file and line, and so are rows whose ground truth the reward cannot use. The layouts and
keys are described in docs/data.md."""

from __future__ import annotations

import base64
import datetime
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from ppo_trainer.agents import Tool, allowed_tools, render_prompt_with_tools, template_ignores_tools
from ppo_trainer.config.schema import DataConfig
from ppo_trainer.data import arithmetic, digits
from ppo_trainer.errors import InputError
from ppo_trainer.models.loading import hub_offline

logger = logging.getLogger("ppo_trainer")

GENERATED = ("arithmetic", "digits")  # built-in generators: their rows have "question" and "answer"
PLAIN_KEYS = ("question", "answer")  # (prompt key, answer key) of GSM8K's jsonl and the generators
VERL_KEYS = ("prompt", "reward_model.ground_truth")  # verl's layout (its examples/data_preprocess)
EXTRA_INFO_KEY = "extra_info"  # verl's per-row metadata, carried as it is
FILES_HINT = "data.train_files=[train.jsonl] data.val_files=[test.jsonl]"

Messages = list[dict[str, str]]  # chat turns [{"role", "content"}]
Converted = list[tuple[str, str]]  # (where in the row, type name) of each value turned into text (`json_value`)


class DataError(InputError):
    """The data cannot be loaded as configured; the one-line message names the key, file or row."""


class MissingKey(ValueError):
    """A row lacks a key (or a part of a dotted path)."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as the trainer, the reward and the validation see it."""

    index: int  # the row's position in its file (generator or hub split), 0-based; malformed rows keep their number
    question: str  # display text: the string prompt, or the last user turn of a message prompt
    prompt: str  # the text the model continues (chat template applied, assistant turn opened)
    prompt_ids: tuple[int, ...]  # the token ids of `prompt`, length <= data.max_prompt_length
    ground_truth: Any  # the answer exactly as in the data: any JSON value (the reward interprets it)
    data_source: str  # the row's data.source_key, else the generator's, hub dataset's or file stem's name
    extra_info: Any = None  # the row's "extra_info", None when absent
    messages: Messages = field(default_factory=list)  # the chat turns rendered into `prompt`
    origin: str = ""  # the file (generator, hub split) the row came from; PromptLoader mixes train origins
    where: str = ""  # the row's place in its source ("path:line", "path row N"): scoring failures name it


@dataclass(frozen=True)
class RawRow:
    """A row as read from its source; `error` says why it could not even be parsed."""

    where: str  # "path:line" for jsonl, "path row N" for parquet, "name[split] row N" for the hub
    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class RowSource:
    """The rows of one file, generator split or hub split."""

    origin: str  # how messages name it: a path, "the arithmetic generator (train)", "openai/gsm8k[test]"
    default_source: str  # the data_source of rows without data.source_key
    rows: list[RawRow]
    keys: Optional[tuple[str, str]] = None  # (prompt key, answer key); None: the config's (`layout_keys`)


@dataclass(frozen=True)
class ParsedRow:
    prompt: Union[str, Messages]  # a non-empty string, or checked chat turns with a user turn
    ground_truth: Any  # as JSON holds it (`json_value`)
    data_source: str
    extra_info: Any  # as JSON holds it
    converted: Converted = field(default_factory=list)  # the parts of ground_truth and extra_info made text


AnswerCheck = Callable[[Any], None]  # raises ValueError for a ground truth the reward cannot read


def load_prompts(cfg: DataConfig, tokenizer: Any, split: str, require_answer: bool = True,
                 check_answer: Optional[AnswerCheck] = None, tools: Sequence[Tool] = ()) -> list[PromptRecord]:
    """The prompts of `split` ("train" or "val"), source after source (`read_split`); DataError
    (one line) when they cannot be loaded. With `require_answer` (a configured reward reads the
    answers: `derived_settings.uses_ground_truth`) a row without an answer, or with a null one, is
    malformed; without, its ground truth is None. `check_answer` (the reward's own rule,
    `rewards.loader.answer_check`) refuses a ground truth the reward of `split` cannot read: a
    malformed row too, found here rather than at the first scoring, after the models loaded. `tools`
    (sampler.multi_turn.tools) are offered in each prompt through the chat template, those a row's
    extra_info.tools_kwargs allows (`agents.render_prompt_with_tools`)."""
    if cfg.use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError("data.use_chat_template=true, but the model's tokenizer has no chat template; "
                        "set data.use_chat_template=false")
    # decided once, not per row: a template shows tools or ignores them whatever the conversation
    in_system = bool(tools) and template_ignores_tools(tokenizer, list(tools), dict(cfg.chat_template_kwargs))
    records = [record for source in read_split(cfg, split)
               for record in load_source(source, cfg, tokenizer, split, require_answer, check_answer, tools,
                                         in_system)]
    if tools and split == "train":  # one console line a run: who shows the model its tools
        where = ("the model's chat template ignores `tools`: their schemas and the Hermes call format went into "
                 "each prompt's system message") if in_system else "the model's chat template shows them"
        logger.info("tools: %s offered to %d training prompts; %s", ", ".join(t.name for t in tools), len(records),
                    where)
    return records


def load_source(source: RowSource, cfg: DataConfig, tokenizer: Any, split: str, require_answer: bool = True,
                check_answer: Optional[AnswerCheck] = None, tools: Sequence[Tool] = (),
                in_system: bool = False) -> list[PromptRecord]:
    """The records of one source: rows parsed, checked and rendered (malformed ones per
    data.bad_rows), tokenized, prompts over data.max_prompt_length per data.overlong_prompts
    (counted per data_source). Values JSON cannot hold become text, said in one line. `tools` go
    into each prompt, into its system message when `in_system` (`agents.template_ignores_tools`)."""
    keys = source.keys or layout_keys(source.rows, cfg.prompt_key, cfg.answer_key)
    prepared: list[tuple[int, str, ParsedRow, Messages, str]] = []  # (index, where, row, turns, prompt text)
    skipped: list[str] = []
    for index, row in enumerate(source.rows):
        try:
            if row.error is not None:
                raise ValueError(row.error)
            parsed = parse_row(row.value, keys, cfg.source_key, source.default_source, require_answer)
            if check_answer is not None:
                check_answer(parsed.ground_truth)
            turns = chat_messages(parsed.prompt, cfg)
            if tools:
                text = render_prompt_with_tools(tokenizer, turns, allowed_tools(list(tools), parsed.extra_info),
                                                dict(cfg.chat_template_kwargs), in_system)[0]
            else:
                text = render_prompt(turns, tokenizer, cfg.use_chat_template, dict(cfg.chat_template_kwargs))
        except DataError:
            raise
        except ValueError as e:
            if cfg.bad_rows != "skip":
                raise DataError(f"{row.where}: {e}; fix the row or set data.bad_rows=skip to skip malformed "
                                "rows") from None
            skipped.append(f"{row.where}: {e}")
            continue
        prepared.append((index, row.where, parsed, turns, text))
    if skipped:
        logger.warning("data: skipped %d malformed %s rows of %s (data.bad_rows=skip); the first: %s",
                       len(skipped), split, source.origin, skipped[0])
    converted = [part for _, _, parsed, _, _ in prepared for part in parsed.converted]
    if converted:
        logger.info("data: converted %d values JSON cannot hold to text in %s (first: %s, a %s): ISO 8601 dates "
                    "and times, decimals as written, bytes as base64; the reward function gets the text",
                    len(converted), source.origin, *converted[0])

    texts = [text for *_, text in prepared]
    ids = tokenizer(texts, add_special_tokens=not cfg.use_chat_template)["input_ids"] if texts else []
    records: list[PromptRecord] = []
    dropped: Counter[str] = Counter()
    for (index, where, parsed, turns, text), prompt_ids in zip(prepared, ids):
        if len(prompt_ids) > cfg.max_prompt_length:
            if cfg.overlong_prompts == "error":
                raise DataError(f"{where}: the prompt is {len(prompt_ids)} tokens, longer than data.max_prompt_length="
                                f"{cfg.max_prompt_length}; raise data.max_prompt_length, shorten the prompt, or set "
                                "data.overlong_prompts=drop to drop such prompts")
            dropped[parsed.data_source] += 1
            continue
        records.append(PromptRecord(index, display_text(parsed.prompt), text, tuple(prompt_ids), parsed.ground_truth,
                                    parsed.data_source, parsed.extra_info, turns, source.origin, where))
    report_dropped(dropped, Counter(p.data_source for _, _, p, _, _ in prepared), split, cfg.max_prompt_length)
    if not records:
        raise DataError(f"{source.origin}: no {split} prompts left ({len(source.rows)} rows read, {len(skipped)} "
                        f"malformed and skipped, {sum(dropped.values())} longer than data.max_prompt_length="
                        f"{cfg.max_prompt_length} tokens); check the data or raise data.max_prompt_length")
    sources = Counter(r.data_source for r in records)
    named = "" if set(sources) == {source.default_source} else "; data_source " + ", ".join(
        f"{name} ({count})" for name, count in sources.items())
    logger.info("data: %d %s prompts from %s%s", len(records), split, source.origin, named)
    return records


def report_dropped(dropped: Counter[str], totals: Counter[str], split: str, max_prompt_length: int) -> None:
    """One console line per data_source that lost prompts to data.max_prompt_length: info for
    training, a warning for validation (that source's accuracy covers only the prompts that fit)."""
    for name, count in dropped.items():
        consequence = f"; val/{name}/* count the {totals[name] - count} that fit" if split == "val" else ""
        logger.log(logging.WARNING if split == "val" else logging.INFO,
                   "data: dropped %d of %d %s prompts of data_source %s longer than data.max_prompt_length=%d tokens "
                   "(data.overlong_prompts=drop)%s", count, totals[name], split, name, max_prompt_length, consequence)


def read_split(cfg: DataConfig, split: str) -> list[RowSource]:
    """The sources of `split`: its files (data.train_files / data.val_files) when it has any,
    whatever data.source says; else data.source's generator or hub split."""
    key = f"data.{split}_files"
    paths = [Path(p) for p in (cfg.train_files if split == "train" else cfg.val_files)]
    if paths:
        for path in paths:
            if not path.is_file():
                raise DataError(f"{key}: file not found: {path}")
            if path.suffix not in (".jsonl", ".parquet"):
                raise DataError(f"{key}: {path} is neither .jsonl nor .parquet; convert it to one of them")
        return [RowSource(str(path), path.stem, read_file(path)) for path in paths]
    if cfg.source == "files":
        raise DataError(f"{key} is empty; data.source=files needs jsonl or parquet files: {FILES_HINT}")
    if cfg.source in GENERATED:
        try:  # by data_source: the arithmetic generator validates on two sets
            sets = (arithmetic.generate_sources(cfg.arithmetic, split) if cfg.source == "arithmetic"
                    else {cfg.source: digits.generate_rows(cfg.digits, split)})
        except ValueError as e:
            raise DataError(str(e)) from None
        what = f"{cfg.digits.task}, {split}" if cfg.source == "digits" else split
        return [RowSource(f"the {cfg.source} generator ({what if name == cfg.source else f'{name}, {split}'})", name,
                          [RawRow(f"{name}[{split}] row {i}", row) for i, row in enumerate(problems)], PLAIN_KEYS)
                for name, problems in sets.items()]
    hub_split = cfg.train_split if split == "train" else cfg.val_split
    return [RowSource(f"{cfg.source}[{hub_split}]", cfg.source, read_hub(cfg.source, cfg.hub_config, hub_split))]


def describe_split(cfg: DataConfig, split: str) -> str:
    """What `read_split` reads for `split`, without reading it (the dry-run plan)."""
    files = list(cfg.train_files if split == "train" else cfg.val_files)
    if files:
        return f"data.{split}_files " + ", ".join(files)
    if cfg.source == "files":
        return f"data.{split}_files, which is empty"
    if cfg.source == "arithmetic":
        return f"the arithmetic generator: {arithmetic.describe(cfg.arithmetic, split)}"
    if cfg.source in GENERATED:
        return f"the {cfg.source} generator"
    return f"{cfg.source}[{cfg.train_split if split == 'train' else cfg.val_split}] from the hub"


def read_file(path: Path) -> list[RawRow]:
    """Rows of a .parquet or .jsonl file. jsonl: blank lines ignored; a line that is not UTF-8 or
    not JSON an error row. DataError naming the file when a parquet file cannot be read."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{path}: not a readable parquet file ({reason}); the file may be cut short or "
                            "not parquet: write it again") from None
        return [RawRow(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())]
    rows = []
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                rows.append(RawRow(where, error=f"not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of "
                                                "the line); save the file as UTF-8"))
                continue
            if not line.strip():
                continue
            try:
                rows.append(RawRow(where, json.loads(line)))
            except json.JSONDecodeError as e:
                rows.append(RawRow(where, error=f"invalid JSON ({e.msg} at column {e.colno})"))
    return rows


def read_hub(name: str, config: str | None, split: str) -> list[RawRow]:
    """Rows of a hub dataset split through `datasets.load_dataset` (its local cache when offline)."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        reason = ("is not in the local Hugging Face cache and the hub is offline" if hub_offline(datasets=True)
                  else f"could not be loaded ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})")
        raise DataError(f"data.source={name} (config {config}, split {split}) {reason}; pass local files: "
                        f"{FILES_HINT}") from e
    return [RawRow(f"{name}[{split}] row {i}", row) for i, row in enumerate(dataset)]


def layout_keys(rows: list[RawRow], prompt_key: Optional[str], answer_key: Optional[str]) -> tuple[str, str]:
    """(prompt key, answer key) of a source: each one configured, else the layout's: verl's
    (`VERL_KEYS`) when the first row that is an object has a "reward_model", else `PLAIN_KEYS`."""
    first = next((row.value for row in rows if isinstance(row.value, dict)), None)
    defaults = VERL_KEYS if first is not None and "reward_model" in first else PLAIN_KEYS
    return prompt_key or defaults[0], answer_key or defaults[1]


def lookup(row: dict[str, Any], key: str) -> Any:
    """`row[key]` when the row has that literal key (a column whose name holds a dot wins), else the
    dotted path `key` through nested objects. MissingKey names the key and what the row has there."""
    if key in row:
        return row[key]
    node: Any = row
    walked: list[str] = []
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            holder = f"'{'.'.join(walked)}'" if walked else "row"
            has = ", ".join(map(str, node)) if isinstance(node, dict) else f"a {type(node).__name__}, no keys"
            raise MissingKey(f"missing key '{key}' ({holder} has: {has or 'no keys'})")
        walked.append(part)
        node = node[part]
    return node


def parse_row(row: Any, keys: tuple[str, str], source_key: str, default_source: str,
              require_answer: bool = True) -> ParsedRow:
    """The prompt, ground truth (any value; None when absent or null and not `require_answer`),
    data_source and extra_info of one row, the last two as JSON holds them (`json_value`);
    ValueError says what is wrong with it."""
    prompt_key, answer_key = keys
    if not isinstance(row, dict):
        raise ValueError(f"expected an object with '{prompt_key}' and '{answer_key}', got {type(row).__name__}")
    prompt = check_prompt(lookup(row, prompt_key), prompt_key)
    try:
        truth = lookup(row, answer_key)
    except MissingKey:
        if require_answer:
            raise
        truth = None
    if truth is None and require_answer:
        raise ValueError(f"'{answer_key}' is null, but the reward function (reward.fn, eval.reward_fn) reads it")
    try:
        source = lookup(row, source_key)
    except MissingKey:
        source = None
    if source is None:
        source = default_source
    elif not isinstance(source, str) or not source.strip():
        raise ValueError(f"'{source_key}' (data.source_key) must be a non-empty string, the name its metrics are "
                         f"reported under; got {type(source).__name__} {source!r:.40}")
    truth, converted_truth = json_value(truth, answer_key)
    extra_info, converted_extra = json_value(row.get(EXTRA_INFO_KEY), EXTRA_INFO_KEY)
    return ParsedRow(prompt, truth, source, extra_info, converted_truth + converted_extra)


def json_value(value: Any, where: str) -> tuple[Any, Converted]:
    """`value` as JSON holds it, with (where, type name) of each part turned into text: a date or
    time in ISO 8601, bytes in base64, anything else JSON has no type for (a Decimal: its exact
    digits) as str(); numpy scalars and arrays become Python numbers and lists. Parquet and hub rows
    hold such values, and a record goes to JSON files (samples, validation generations), reward
    workers and reward servers: each must see what the driver's reward function sees."""
    if isinstance(value, (np.generic, np.ndarray)):
        return json_value(value.tolist(), where)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value, []
    if isinstance(value, dict):
        parts = {key: json_value(item, f"{where}.{key}") for key, item in value.items()}
        return {key: part[0] for key, part in parts.items()}, [c for _, converted in parts.values() for c in converted]
    if isinstance(value, (list, tuple)):
        parts = [json_value(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return [part[0] for part in parts], [c for _, converted in parts for c in converted]
    if isinstance(value, (datetime.date, datetime.time)):  # a datetime is a date
        text = value.isoformat()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        text = base64.b64encode(value).decode("ascii")
    else:
        text = str(value)
    return text, [(where, type(value).__name__)]


def check_prompt(value: Any, key: str) -> Union[str, Messages]:
    """A prompt: a non-empty string, or chat turns (objects with a string "role" and a string
    "content", at least one "user" turn; other fields dropped). ValueError naming `key` otherwise."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"'{key}' is an empty string")
        return value
    if not isinstance(value, list):
        raise ValueError(f"'{key}' must be a non-empty string or a list of chat messages ({{role, content}}), "
                         f"got {type(value).__name__} {value!r:.40}")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"'{key}' message {i} must be an object with a string 'role' and 'content', "
                             f"got {message!r:.60}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"'{key}' message {i} ({message['role']}) has content of type "
                             f"{type(message.get('content')).__name__}; only text content (a string) is supported")
    if not any(message["role"] == "user" for message in value):
        roles = ", ".join(message["role"] for message in value) or "none"
        raise ValueError(f"'{key}' has no user turn (roles: {roles})")
    return [{"role": message["role"], "content": message["content"]} for message in value]


def display_text(prompt: Union[str, Messages]) -> str:
    """A prompt as logs and samples show it: the string, or the content of the last user turn."""
    if isinstance(prompt, str):
        return prompt
    return next(message["content"] for message in reversed(prompt) if message["role"] == "user")


def chat_messages(prompt: Union[str, Messages], cfg: DataConfig) -> Messages:
    """The turns the template renders. A string prompt becomes the user turn (data.prompt_template
    with data.instruction); a message prompt is taken as it is (it needs the chat template).
    data.system_prompt goes first unless None or the turns have a system turn of their own."""
    if isinstance(prompt, str):
        turns = [{"role": "user", "content": user_message(prompt, cfg.prompt_template, cfg.instruction)}]
    elif not cfg.use_chat_template:
        raise ValueError("the prompt is a list of chat messages, which needs the chat template; "
                         "set data.use_chat_template=true")
    else:
        turns = prompt
    if cfg.system_prompt is None or any(turn["role"] == "system" for turn in turns):
        return turns
    return [{"role": "system", "content": cfg.system_prompt}, *turns]


def user_message(question: str, template: str, instruction: str) -> str:
    """The user turn: `template` with {question} and {instruction} filled in; DataError naming
    `data.prompt_template` if it has another placeholder."""
    try:
        return template.format(question=question.strip(), instruction=instruction)
    except (KeyError, IndexError, ValueError) as e:
        raise DataError(f"data.prompt_template={template!r} cannot be filled ({type(e).__name__}: {e}); it may use "
                        "only {question} and {instruction} (write literal braces as {{ }})") from None


def render_prompt(turns: Messages, tokenizer: Any, use_chat_template: bool,
                  chat_template_kwargs: Optional[dict[str, Any]] = None) -> str:
    """The text the model continues: the chat template over `turns` with the assistant turn opened
    (`chat_template_kwargs` passed to it), or without the template the user turn's text. ValueError
    when the template refuses the turns (a role it does not know, turns out of order)."""
    if not use_chat_template:
        return turns[-1]["content"]
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    except Exception as e:  # the template is the model's own code: jinja errors, its raise_exception(...)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        roles = ", ".join(turn["role"] for turn in turns)
        raise ValueError(f"the model's chat template refuses these turns (roles: {roles}): {reason}") from None
