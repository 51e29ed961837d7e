"""How a reward function is found and called, and what its results mean: the calling conventions
users bring (verl's `compute_score` by keyword, `fn(response, ground_truth)`, verl's batch reward
manager, OpenRLHF's `reward_func`), the rows it is given and the scores and named extras it returns.

This module imports neither the config nor torch: the reward workers (`rewards/pool.py`) import
it, and a worker should start in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ppo_trainer.errors import RunError

# verl's NaiveRewardManager passes these by keyword to compute_score (one row), its
# BatchRewardManager their plurals (one batch); OpenRLHF calls reward_func(queries, prompts, labels).
ROW_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
OPENRLHF_ARGS = ("queries", "prompts", "labels")
# reward.* options a function receives when it names them as parameters (and they are given)
OPTIONS = ("mode", "format_score", "correct_score")
# extras that would shadow the trainer's own reward/* metrics (and the reward model's, later)
RESERVED_EXTRAS = ("errors", "timeouts", "model")

SIGNATURES = ("per row (reward.batched=false): fn(data_source, solution_str, ground_truth, extra_info) by keyword "
              "(verl's compute_score; data_source and extra_info optional) or fn(response, ground_truth) (exactly "
              "two required positional parameters); per batch (reward.batched=true): fn(data_sources, "
              "solution_strs, ground_truths, extra_infos) by keyword (verl's batch reward manager) or "
              "fn(queries, prompts, labels, **kwargs) (OpenRLHF's reward_func); see docs/rewards.md")


class SignatureError(ValueError):
    """A function's parameters match no accepted signature; the message says why."""


class RewardError(RunError):
    """Scoring cannot go on: a row failed under reward.on_error=raise, or the reward workers cannot
    start. The run stops (exit 1) with this one-line message."""


@dataclass(frozen=True)
class RewardInput:
    """What a reward function can be told about one response."""

    response: str  # the decoded response (special tokens skipped, cut at a stop string)
    ground_truth: Any  # the record's, exactly as in the data
    data_source: str
    extra_info: Any  # the record's extra_info, None when absent
    prompt: str  # the rendered prompt the model continued (chat template applied)
    messages: Sequence[Mapping[str, Any]] = ()  # the prompt's chat turns (a reward model renders them its way)
    where: str = ""  # the data row it answers ("path:line", "path row N"), for failure messages


@dataclass(frozen=True)
class Calling:
    """How to call one reward function. kind: "row" (keyword arguments `args`, verl's names), "pair"
    (`fn(response, ground_truth)` positionally), "batch" (keyword lists `args`, verl's plurals) or
    "openrlhf" (`fn(queries=, prompts=, labels=)`); `options`: reward.* values passed by keyword."""

    kind: str
    args: tuple[str, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def batched(self) -> bool:
        return self.kind in ("batch", "openrlhf")


@dataclass(frozen=True)
class RewardSpec:
    """What a process needs to load and call the same reward function (a reward worker gets it)."""

    fn: str  # reward.fn, a file path made absolute
    calling: Calling


@dataclass(frozen=True)
class Failure:
    """A row the function did not score: its reason (one line) and whether it was a timeout."""

    reason: str
    timeout: bool = False


RowScore = tuple[float, dict[str, Any]]  # (score, named extras: numbers as float, other values as str or None)
Outcome = Union[RowScore, Failure]


def _is_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target


def absolute_ref(ref: str) -> str:
    """`ref` with a file path made absolute (against the working folder); a module path as it is."""
    target, sep, name = ref.rpartition(":")
    return f"{Path(target).expanduser().resolve()}{sep}{name}" if target and _is_path(target) else ref


def import_reward(ref: str) -> Callable[..., Any]:
    """The function `ref` names ("package.module:function" or "path/to/file.py:function"; see
    `import_attribute`). ImportError or AttributeError with a one-line message."""
    fn = import_attribute(ref, "function", "ppo_trainer.rewards.math:score")
    if not callable(fn):
        raise AttributeError(f"{ref.rpartition(':')[0]} has no function '{ref.rpartition(':')[2]}'")
    return fn


def import_attribute(ref: str, what: str, example: str) -> Any:
    """The object `ref` names: "package.module:name", or "path/to/file.py:name" (a file path,
    relative to the working folder; loaded once per process). Shared by every config key that names
    users' code (a reward function, an environment class, a tool); `what` ("function", "class") and
    `example` word the errors. ImportError or AttributeError with a one-line message; also for a
    module that calls sys.exit while it is imported (the SystemExit would otherwise end the run as
    if it had succeeded)."""
    target, _, name = ref.rpartition(":")
    if not target or not name:
        raise ImportError(f"expected 'module:{what}' or 'path/to/file.py:{what}', e.g. {example}")
    if _is_path(target):
        module = _load_file(Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise ImportError(f"module '{e.name}' cannot be imported; install it or put it on PYTHONPATH") from None
        except (Exception, SystemExit) as e:  # the module's own code failed (a syntax error, a file it reads...)
            raise ImportError(f"importing module '{target}' failed: {one_line(e)}; fix the module") from None
    if not hasattr(module, name):
        raise AttributeError(f"{target} has no {what} '{name}'")
    return getattr(module, name)


def _load_file(path: Path) -> Any:
    """The module of a Python file, executed once per process (under a name made from its absolute path)."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ImportError(f"file {path} not found")
    name = f"ppo_trainer_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look a module up by name
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise ImportError(f"executing {path} failed: {one_line(e)}; fix the file") from None
    return module


def one_line(error: BaseException) -> str:
    """`Type: message` on one line (a message may quote a multi-line ground truth); a SystemExit as
    `SystemExit (code C)`, its exit code (its bare message would be just "0")."""
    if isinstance(error, SystemExit):
        return f"SystemExit (code {error.code!r:.100})".replace("\n", "\\n")
    return f"{type(error).__name__}: {error}".replace("\n", "\\n")


def classify(fn: Callable[..., Any], batched: bool, given: Mapping[str, Any]) -> Calling:
    """How to call `fn` (`Calling`), from its parameter names; `given`: the reward.* options (OPTIONS)
    set to other than their defaults, passed to a function that names them. SignatureError when the
    parameters match no accepted signature (`SIGNATURES`)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        raise SignatureError(f"its signature cannot be read ({e}); wrap it in a Python function") from None
    by_name = {n: p for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    required = [n for n, p in params.items() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    options = tuple((k, v) for k, v in given.items() if k in by_name)
    shown = f"its parameters ({', '.join(params)})"

    def keyword(kind: str, names: Sequence[str], needed: Sequence[str]) -> Calling:
        args = tuple(n for n in names if n in by_name or takes_any)
        missing = [n for n in needed if n not in args]
        unfilled = [n for n in required if n not in args and n not in dict(options)]
        if missing:
            raise SignatureError(f"{shown} lack {', '.join(map(repr, missing))}; accepted: {SIGNATURES}")
        if unfilled:
            raise SignatureError(f"{shown} require {', '.join(map(repr, unfilled))}, which the trainer cannot "
                                 f"pass (give them defaults); accepted: {SIGNATURES}")
        return Calling(kind, args, options)

    if not batched:
        if "solution_str" in by_name:
            return keyword("row", ROW_ARGS, ("solution_str", "ground_truth"))
        positional = [n for n in required if params[n].kind in (params[n].POSITIONAL_ONLY, params[n].POSITIONAL_OR_KEYWORD)]
        if len(positional) == 2 and len(required) == 2:
            return Calling("pair", (), options)
        hint = (" (a batch function: set reward.batched=true)"
                if any(n in by_name for n in ("solution_strs", "queries")) else "")
        raise SignatureError(f"{shown} match no per-row signature{hint}; accepted: {SIGNATURES}")
    if "solution_strs" in by_name:
        return keyword("batch", BATCH_ARGS, ("solution_strs", "ground_truths"))
    if all(n in by_name for n in OPENRLHF_ARGS):
        return keyword("openrlhf", OPENRLHF_ARGS, OPENRLHF_ARGS)
    hint = " (a per-row function: set reward.batched=false)" if "solution_str" in by_name or len(required) == 2 else ""
    raise SignatureError(f"{shown} match no batch signature{hint}; accepted: {SIGNATURES}")


def call(fn: Callable[..., Any], calling: Calling, rows: Sequence[RewardInput]) -> list[Outcome]:
    """One call of `fn` as `calling` says: a per-row kind takes exactly one row, a batch kind all of
    them. Returns one outcome per row; an exception fails every row of the call, and so does a
    sys.exit inside it (the driver or worker goes on); a KeyboardInterrupt stops the caller."""
    if not calling.batched and len(rows) != 1:
        raise ValueError(f"a per-row reward function is called with one row, got {len(rows)}")
    options = dict(calling.options)
    try:
        if calling.kind == "pair":
            return [read_score(fn(rows[0].response, rows[0].ground_truth, **options))]
        if calling.kind == "row":
            values = dict(zip(ROW_ARGS, _fields(rows[0])))
            return [read_score(fn(**{a: values[a] for a in calling.args}, **options))]
        columns = dict(zip(BATCH_ARGS, map(list, zip(*map(_fields, rows)))))
        if calling.kind == "batch":
            return read_batch(fn(**{a: columns[a] for a in calling.args}, **options), len(rows))
        return read_openrlhf(fn(queries=[r.prompt + r.response for r in rows], prompts=[r.prompt for r in rows],
                                labels=[r.ground_truth for r in rows], **options), len(rows))
    except (Exception, SystemExit) as e:
        return [Failure(one_line(e))] * len(rows)


def _fields(row: RewardInput) -> tuple[Any, ...]:
    """A row's values in ROW_ARGS order (solution_str: the response)."""
    return row.data_source, row.response, row.ground_truth, row.extra_info


def plain_value(value: Any) -> Any:
    """A numpy scalar, 0-d array or 0-d tensor as the Python number it holds; anything else as it is."""
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        return value.item()
    return value


def number_value(value: Any) -> Optional[float]:
    """`value` as a float when it is a number (bool, int, float, numpy or 0-d tensor scalar), else None."""
    value = plain_value(value)
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None


def read_score(value: Any) -> RowScore:
    """(score, extras) of what a per-row call returned: a finite number, or a mapping with a finite
    number under "score" and named extras (numbers become floats; "acc" must be a number or a bool;
    other values are kept as text). ValueError for anything else, non-finite scores and reserved names."""
    extras: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys {sorted(map(str, value))}); a reward dict "
                             "needs a number under 'score'")
        extras = read_extras({k: v for k, v in value.items() if k != "score"})
        value = value["score"]
    return finite_score(value), extras


def finite_score(value: Any) -> float:
    """`value` as a float when it is a finite number (an int, a float, a numpy or 0-d tensor scalar;
    not a bool, not a numeric string): the one rule for every score, a function's, a reward model's
    or a server's. ValueError naming what it was otherwise."""
    value = plain_value(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"returned {value!r:.100} as the score; a score must be a finite number")
    return float(value)


def read_extras(extras: Mapping[Any, Any]) -> dict[str, Any]:
    """Named extras: numbers as floats, None as None, anything else as its text. ValueError for a
    reserved name (RESERVED_EXTRAS) or an "acc" that is not a number."""
    out: dict[str, Any] = {}
    for name, value in extras.items():
        name = str(name)
        if name in RESERVED_EXTRAS:
            raise ValueError(f"returned the extra '{name}', a reserved name ({', '.join(RESERVED_EXTRAS)} are the "
                             "trainer's reward/* metrics); rename it")
        number = number_value(value)
        if name == "acc" and number is None:
            raise ValueError(f"returned acc={value!r:.60}; 'acc' (validation's correctness) must be a number or a bool")
        out[name] = number if number is not None else None if value is None else str(value)
    return out


def _column(value: Any, rows: int, what: str) -> list[Any]:
    """A list, tuple, numpy array or tensor of `rows` values as a list; ValueError otherwise."""
    value = value.tolist() if callable(getattr(value, "tolist", None)) else value
    if not isinstance(value, (list, tuple)) or len(value) != rows:
        shown = f"{len(value)} values" if isinstance(value, (list, tuple)) else f"{type(value).__name__} {value!r:.60}"
        raise ValueError(f"returned {shown} as {what} for a batch of {rows} rows; return one per row")
    return list(value)


def read_batch(values: Any, rows: int) -> list[Outcome]:
    """Outcomes of a verl batch function's result: one number or dict per row (`read_score` each)."""
    outcomes: list[Outcome] = []
    for value in _column(values, rows, "scores"):
        try:
            outcomes.append(read_score(value))
        except ValueError as e:
            outcomes.append(Failure(one_line(e)))
    return outcomes


def read_openrlhf(value: Any, rows: int) -> list[Outcome]:
    """Outcomes of an OpenRLHF reward_func's result: {"rewards": [B], optional "scores": [B],
    optional "extra_logs": {name: [B] or a scalar}} (tensors or lists), or the rewards alone. The
    rewards are the scores; "scores" and each extra_logs entry become extras of those names."""
    if not isinstance(value, Mapping):
        value = {"rewards": value}
    if "rewards" not in value:
        raise ValueError(f"returned a dict without 'rewards' (keys {sorted(map(str, value))}); OpenRLHF's "
                         "reward_func returns {'rewards': ..., 'scores': ..., 'extra_logs': {...}}")
    named = {"scores": value["scores"]} if value.get("scores") is not None else {}
    named.update(value.get("extra_logs") or {})
    columns = {name: ([v] * rows if getattr(v, "shape", None) == () or isinstance(v, (int, float)) else
                      _column(v, rows, f"extra_logs['{name}']")) for name, v in named.items()}
    outcomes: list[Outcome] = []
    for i, reward in enumerate(_column(value["rewards"], rows, "rewards")):
        try:
            outcomes.append(read_score({"score": reward, **{name: column[i] for name, column in columns.items()}}))
        except ValueError as e:
            outcomes.append(Failure(one_line(e)))
    return outcomes
