"""The scoring side of a reward server (`ppo-serve-reward`, in `serve_reward.py`): a request read
and checked, its rows scored by a reward function (`FunctionService`) or a reward model
(`ModelService`), and the answer, in which a row that fails is answered as failed (`errors`) in
general terms: no answer quotes the request's data or an exception's text (which may quote it)."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from omegaconf import OmegaConf

from ppo_trainer.config.schema import RewardConfig
from ppo_trainer.rewards.calling import Failure, RewardInput, finite_score
from ppo_trainer.rewards.scoring import FunctionScorer, build_scorer

log = logging.getLogger("ppo_trainer")

ROW_KEYS = ("labels", "data_sources", "extra_infos", "messages")  # optional, one value per query
INVALID_RESULT = "the reward function returned no valid score (a finite number, or a dict with one under 'score')"
MODEL_NON_FINITE = "the reward model gave no finite score"


@dataclass
class Answer:
    """A request's answer, B rows: each row's reward (None: failed under --on-error fail), the reason
    it failed (general terms, never the row's data), numeric extras (None where a row has none), and
    the rows that failed by reason (those --on-error zero scored 0 included), for the log line."""

    rewards: list[Optional[float]]
    errors: list[Optional[str]]
    extras: dict[str, list[Optional[float]]] = field(default_factory=dict)
    failures: Counter = field(default_factory=Counter)

    def payload(self) -> dict[str, Any]:
        """The JSON answer; "scores" repeats the rewards, as OpenRLHF's servers answer."""
        return {"rewards": self.rewards, "scores": self.rewards, "extra_logs": self.extras, "errors": self.errors}


RowOutcome = Union[tuple[float, dict[str, Any]], str]  # (score, extras), or why the row failed
Score = Callable[[dict[str, list]], Answer]  # a checked request (`read_request`) -> its answer; close() if it has one


def answer_rows(outcomes: Sequence[RowOutcome], on_error: str) -> Answer:
    """The Answer of per-row outcomes. A failed row: reward None and its reason under on_error "fail";
    reward 0.0 and no error under "zero" (the client then counts it as scored). Extras: each name a
    row gave a number for, per row that finite number or None (strict JSON holds no NaN; text is
    left out)."""
    failed = [o if isinstance(o, str) else None for o in outcomes]
    zero = on_error == "zero"
    rewards = [(0.0 if zero else None) if reason else o[0] for o, reason in zip(outcomes, failed)]
    extras = [{} if reason else o[1] for o, reason in zip(outcomes, failed)]
    names = sorted({name for row in extras for name, value in row.items() if isinstance(value, float)})
    columns = {name: [_finite(row.get(name)) for row in extras] for name in names}
    errors = [None] * len(failed) if zero else failed
    return Answer(rewards, errors, columns, Counter(reason for reason in failed if reason))


def _finite(value: Any) -> Optional[float]:
    return value if isinstance(value, float) and math.isfinite(value) else None


def function_failure(failure: Failure, timeout_s: Optional[float]) -> str:
    """A failed call in general terms: the exception's type, never its message (which may quote the
    row). Reads `calling`'s reasons: "Type: message" (`one_line`), "ValueError: returned ..." for a
    result that is no score (`read_score`), the pool's worker death and timeout."""
    if failure.timeout:
        return f"the reward function did not return within --timeout-s={timeout_s:g} s"
    if failure.reason.startswith("the reward worker died"):
        return "the reward worker process died during the call"
    if failure.reason.startswith("ValueError: returned "):
        return INVALID_RESULT
    kind = failure.reason.partition(":")[0]
    return f"the reward function raised {kind}" if kind.isidentifier() else "the reward function failed"


class FunctionService:
    """`--fn`: each response is its query less its prompt; labels are the ground truths."""

    def __init__(self, scorer: FunctionScorer, on_error: str, timeout_s: Optional[float]):
        self.scorer, self.on_error, self.timeout_s = scorer, on_error, timeout_s

    def __call__(self, request: dict[str, list]) -> Answer:
        rows = [RewardInput(q[len(p):] if q.startswith(p) else q, label, source or "remote", extra, p, messages or ())
                for q, p, label, source, extra, messages in zip(request["query"], request["prompts"],
                                                                *(request[key] for key in ROW_KEYS))]
        outcomes = [function_failure(o, self.timeout_s) if isinstance(o, Failure) else o
                    for o in self.scorer.outcomes(rows)]
        return answer_rows(outcomes, self.on_error)

    def close(self) -> None:
        """Ends the worker pool, if any."""
        self.scorer.close()


def function_scorer(fn: str, num_workers: int = 0, timeout_s: Optional[float] = None, batched: bool = False,
                    on_error: str = "fail") -> FunctionService:
    """Scores rows with the reward function `fn` (any signature `reward.fn` takes). A timeout needs a
    worker process to kill, so `timeout_s` without workers starts one (and says so)."""
    if timeout_s is not None and num_workers == 0:
        log.info("ppo-serve-reward: --timeout-s needs a worker process: starting one (--num-workers 1)")
        num_workers = 1
    cfg = OmegaConf.structured(RewardConfig(fn=fn, num_workers=num_workers, timeout_s=timeout_s, batched=batched))
    return FunctionService(build_scorer(cfg, key="--fn"), on_error, timeout_s)


class ModelService:
    """`--model`: the prompt's chat turns and the response in the model's own template when the
    request carries `messages` (a ppo-train client does), else each query's text as it comes
    (OpenRLHF's clients send the conversation rendered). A non-finite score fails its row."""

    def __init__(self, engine: Any, on_error: str):
        self.engine, self.on_error = engine, on_error

    def __call__(self, request: dict[str, list]) -> Answer:
        queries, prompts, messages = request["query"], request["prompts"], request["messages"]
        if not queries:
            return answer_rows([], self.on_error)
        if all(messages):
            responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
            values = self.engine.score_texts(messages, responses).tolist()
        else:
            values = self.engine.score_plain(queries).tolist()
        return answer_rows([_model_outcome(v) for v in values], self.on_error)


def _model_outcome(value: Any) -> RowOutcome:
    try:
        return finite_score(value), {}
    except ValueError:
        return MODEL_NON_FINITE


def model_scorer(path: str, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False,
                 on_error: str = "fail") -> ModelService:
    """Scores rows with the reward model at `path` (a sequence classifier with one label); ValueError
    naming --model for a path that cannot be found, before torch loads."""
    from ppo_trainer.models.loading import model_path_problem, resolve_model_path

    problem = model_path_problem(path, key="--model")
    if problem:
        raise ValueError(problem)
    from ppo_trainer.engine.reward_model import RewardModelEngine

    engine = RewardModelEngine(resolve_model_path(path), dtype=dtype, device=device,
                               trust_remote_code=trust_remote_code)
    return ModelService(engine, on_error)


class RequestError(ValueError):
    """A request the server cannot read; the message (general: it quotes no data) is the 400's."""


def read_request(body: bytes) -> dict[str, list]:
    """The request in `body`: "query" (texts), "prompts" (texts; "" when absent) and `ROW_KEYS` (None
    when absent), one value per query. RequestError naming the key that is wrong."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise RequestError("the body is not JSON (UTF-8)") from None
    if not isinstance(request, dict) or not _texts(request.get("query")):
        raise RequestError('expected a JSON object with "query": a list of texts (OpenRLHF\'s remote reward protocol)')
    n = len(request["query"])
    checked = {"query": request["query"]}
    for key in ("prompts", *ROW_KEYS):
        column = request.get(key)
        if column is None:
            column = [""] * n if key == "prompts" else [None] * n
        if not isinstance(column, list) or len(column) != n:
            given = f"{len(column)} values" if isinstance(column, list) else "no list"
            raise RequestError(f'"{key}" has {given} for {n} queries; send one per query, or leave it out')
        checked[key] = column
    if not _texts(checked["prompts"]):
        raise RequestError('"prompts" must be a list of texts')
    return checked


def _texts(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
