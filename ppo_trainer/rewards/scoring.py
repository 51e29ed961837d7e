"""Scoring a batch of responses: the one place that turns rows into scores, named extras and
counts of failed and timed-out rows, under `reward.on_error`. `FunctionScorer` calls `reward.fn`
in the driver or on a worker pool (`rewards/pool.py`); a scorer of another kind (a reward model,
a reward server) is a `Scorer` beside it. Training and validation share one scorer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

from ppo_trainer.config import ConfigError, RewardConfig
from ppo_trainer.rewards.calling import Calling, Failure, Outcome, RewardError, RewardInput, call
from ppo_trainer.rewards.loader import given_options, resolve
from ppo_trainer.rewards.pool import WorkerPool


@dataclass
class Scores:
    """A batch's scores, B rows."""

    values: list[float]  # [B]; a failed row's is 0.0 (reward.on_error=zero)
    extras: list[dict[str, Any]] = field(default_factory=list)  # [B] each row's named extras; {} for a failed row
    errors: int = 0  # rows scored by reward.on_error: exceptions, invalid results, timeouts, dead workers
    timeouts: int = 0  # of those, the calls that outlived reward.timeout_s

    def extra_means(self) -> dict[str, float]:
        """Each numeric extra's mean over the rows that returned it as a number."""
        numbers: dict[str, list[float]] = {}
        for extras in self.extras:
            for name, value in extras.items():
                if isinstance(value, float):
                    numbers.setdefault(name, []).append(value)
        return {name: sum(values) / len(values) for name, values in numbers.items()}


@dataclass(frozen=True)
class Accuracy:
    """When validation counts a response correct: its "acc" extra when the function returns one
    (verl's convention; acc's value, so mean@n averages it and pass@n takes a prompt's best), else
    score >= threshold (reward.correct_score). `threshold_only`: reward.correct_score was given for
    a function that does not take it, so the threshold is its only use and an "acc" would leave it
    unused: a ConfigError."""

    threshold: float = RewardConfig.correct_score
    threshold_only: bool = False

    def correct(self, score: float, extras: Mapping[str, Any]) -> Union[bool, float]:
        if "acc" not in extras:
            return score >= self.threshold
        if self.threshold_only:
            raise ConfigError(f"'reward.correct_score' is {self.threshold}, but reward.fn returns 'acc', which decides "
                              "validation accuracy, and takes no 'correct_score' parameter: the value would be "
                              "ignored; remove reward.correct_score")
        return extras["acc"]


def accuracy_rule(cfg: RewardConfig, calling: Calling) -> Accuracy:
    given = "correct_score" in given_options(cfg)
    return Accuracy(cfg.correct_score, threshold_only=given and "correct_score" not in dict(calling.options))


class Scorer(Protocol):
    """Turns rows into `Scores` (raising RewardError for a failed row under reward.on_error=raise)."""

    accuracy: Accuracy

    def score(self, rows: Sequence[RewardInput]) -> Scores: ...

    def close(self) -> None: ...


class FunctionScorer:
    """A reward function called as `calling` says: one call per row, or one per batch for a batched
    function; in this process, or on `pool` (which bounds each call by reward.timeout_s)."""

    def __init__(self, fn: Callable[..., Any], calling: Calling, on_error: str = "raise",
                 accuracy: Accuracy = Accuracy(), pool: Optional[WorkerPool] = None):
        self.fn, self.calling, self.on_error, self.accuracy, self.pool = fn, calling, on_error, accuracy, pool

    def score(self, rows: Sequence[RewardInput]) -> Scores:
        """Scores of `rows`. A failed row (`Failure`) raises RewardError naming it under
        on_error="raise" (in this process, before the next call), else scores 0.0 and is counted."""
        tasks = [list(rows)] if self.calling.batched else [[row] for row in rows]
        scores = Scores([], [])
        if self.pool is not None:
            outcomes = [o for task in self.pool.map(tasks) for o in task]
            for row, outcome in enumerate(outcomes):
                self._add(scores, row, outcome, rows)
            return scores
        for task in tasks:
            for outcome in call(self.fn, self.calling, task):
                self._add(scores, len(scores.values), outcome, rows)
        return scores

    def _add(self, scores: Scores, row: int, outcome: Outcome, rows: Sequence[RewardInput]) -> None:
        if not isinstance(outcome, Failure):
            scores.values.append(outcome[0])
            scores.extras.append(outcome[1])
            return
        if self.on_error != "zero":
            raise RewardError(failure_line(row, rows[row], outcome))
        scores.values.append(0.0)
        scores.extras.append({})
        scores.errors += 1
        scores.timeouts += outcome.timeout

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def failure_line(row: int, value: RewardInput, failure: Failure) -> str:
    """One line naming a failed row: its number, data_source, ground truth and response (each cut at
    300 characters), the reason, and what to do."""
    shown = value.response if len(value.response) <= 300 else value.response[:300] + "..."
    return (f"reward function failed on row {row} (data_source {value.data_source}, ground truth "
            f"{value.ground_truth!r:.300}, response {shown!r}): {failure.reason}; fix it or set reward.on_error=zero "
            "to score such rows 0")


def build_scorer(cfg: RewardConfig) -> FunctionScorer:
    """The scorer of `reward.*`: the function `resolve`d, on `reward.num_workers` workers (0: in
    this process) with calls bounded by `reward.timeout_s`. ConfigError for a bad reward.fn,
    RewardError when the workers cannot load it."""
    fn, spec = resolve(cfg)
    pool = WorkerPool(spec, cfg.num_workers, cfg.timeout_s) if cfg.num_workers > 0 else None
    return FunctionScorer(fn, spec.calling, cfg.on_error, accuracy_rule(cfg, spec.calling), pool)


def reward_metrics(scores: Scores, cfg: RewardConfig) -> dict[str, float]:
    """A training step's reward/* metrics: reward/errors (on_error=zero), reward/timeouts (and
    timeout_s set), reward/<name>/mean of each numeric extra."""
    metrics: dict[str, float] = {}
    if cfg.on_error == "zero":
        metrics["reward/errors"] = scores.errors
        if cfg.timeout_s is not None:
            metrics["reward/timeouts"] = scores.timeouts
    metrics.update({f"reward/{name}/mean": mean for name, mean in scores.extra_means().items()})
    return metrics
