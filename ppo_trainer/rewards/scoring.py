"""Scoring a batch of responses: the one place that turns rows into scores, named extras and
counts of failed and timed-out rows, under `reward.on_error`. `FunctionScorer` calls `reward.fn`
in the driver or on a worker pool (`rewards/pool.py`); a scorer of another kind (a reward model,
a reward server) is a `Scorer` beside it. Training and validation share one scorer.

One rule for every learned or remote score (`calling.finite_score`): a value that is not a finite
number (NaN, inf, a bool, text, null) fails its row under `reward.on_error`, like a function's
failed call. The running normalisation leaves failed rows out of its statistics, and a save or a
resume refuses statistics that are not finite (`nonfinite_statistics`)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

from omegaconf import OmegaConf

from ppo_trainer.config.schema import ConfigError, RewardConfig
from ppo_trainer.config.secrets import redact_url
from ppo_trainer.models.score_stats import SCORE_STATS, read_score_stats
from ppo_trainer.rewards.calling import (
    Calling,
    Failure,
    Outcome,
    RewardError,
    RewardInput,
    absolute_ref,
    call,
    finite_score,
)
from ppo_trainer.rewards.loader import given_options, resolve, start_workers
from ppo_trainer.rewards.pool import WorkerPool
from ppo_trainer.rewards.remote import RemoteRewardClient, bearer_token
from ppo_trainer.run.resume import nonfinite_statistics

log = logging.getLogger("ppo_trainer")


@dataclass
class Scores:
    """A batch's scores, B rows."""

    values: list[float]  # [B]; a failed row's is 0.0 (reward.on_error=zero)
    extras: list[dict[str, Any]] = field(default_factory=list)  # [B] each row's named extras; {} for a failed row
    errors: int = 0  # rows scored by reward.on_error: exceptions, invalid results, timeouts, dead workers
    timeouts: int = 0  # of those, the calls that outlived reward.timeout_s
    failed: list[int] = field(default_factory=list)  # a reward model's or server's failed rows (RunningNorm skips them)

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

    def outcomes(self, rows: Sequence[RewardInput]) -> list[Outcome]:
        """Each row's outcome, a failed row's `Failure` included whatever reward.on_error says: for a
        caller that reports failures row by row (ppo-serve-reward answers them to its client)."""
        tasks = [list(rows)] if self.calling.batched else [[row] for row in rows]
        if self.pool is not None:
            return [o for task in self.pool.map(tasks) for o in task]
        return [o for task in tasks for o in call(self.fn, self.calling, task)]

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
    """One line naming a failed row: its number, the data row it answers (file and line), data_source,
    ground truth and response (each cut at 300 characters), the reason, and what to do."""
    shown = value.response if len(value.response) <= 300 else value.response[:300] + "..."
    origin = f"{value.where}, " if value.where else ""
    return (f"reward function failed on row {row} ({origin}data_source {value.data_source}, ground truth "
            f"{value.ground_truth!r:.300}, response {shown!r}): {failure.reason}; fix it or set reward.on_error=zero "
            "to score such rows 0")


def build_scorer(cfg: RewardConfig, key: str = "reward.fn") -> Optional[FunctionScorer]:
    """The scorer of `reward.*`: the function `resolve`d, on `reward.num_workers` workers (0: in
    this process) with calls bounded by `reward.timeout_s`; None when `cfg.fn` is null. ConfigError
    for a bad reward.fn (`key` names it), in the driver or in a worker; RewardError when a worker
    exits or hangs while loading it."""
    if cfg.fn is None:
        return None
    fn, spec = resolve(cfg, key)
    pool = start_workers(cfg, spec, key)
    return FunctionScorer(fn, spec.calling, cfg.on_error, accuracy_rule(cfg, spec.calling), pool)


def reward_metrics(scores: Scores, cfg: RewardConfig) -> dict[str, float]:
    """A training step's reward/* metrics: reward/errors (on_error=zero), reward/timeouts (and
    timeout_s set), reward/<name>/mean of each numeric extra."""
    metrics: dict[str, float] = {}
    if cfg.on_error == "zero":
        metrics["reward/errors"] = scores.errors
        if cfg.timeout_s is not None or cfg.remote.url:  # a server's requests are always bounded
            metrics["reward/timeouts"] = scores.timeouts
    metrics.update({f"reward/{name}/mean": mean for name, mean in scores.extra_means().items()})
    if cfg.model.path:  # a learned reward's spread matters as much as its level
        values = [extras["model"] for extras in scores.extras if isinstance(extras.get("model"), float)]
        mean = sum(values) / len(values) if values else 0.0
        metrics["reward/model/std"] = (sum((v - mean) ** 2 for v in values) / max(len(values), 1)) ** 0.5
    return metrics


class RunningNorm:
    """Scores standardised by the running mean and std of every score seen so far (this batch's
    included: the first batch is standardised by itself), then clipped to [-clip, clip]: the scale
    of a learned reward then leaves the PPO step size alone. A failed row (`failed`) is left out of
    the statistics and scores 0 after normalisation: one bad answer must not move, or poison, the
    scale every later score is read on. The statistics are part of the checkpoint (`state_dict`), so
    a resumed run normalises as the uninterrupted one."""

    def __init__(self, normalize: bool, clip: Optional[float], start: Optional[Mapping[str, float]] = None):
        """`start`: {"mean", "std", "count"} the statistics begin with (a reward model's score_stats.json)
        as if it had seen `count` scores of that mean and std; None: from nothing."""
        self.normalize, self.clip = normalize, clip
        self.count, self.mean, self.m2 = 0, 0.0, 0.0  # Welford's running sums
        if start is not None:
            self.count, self.mean = int(start["count"]), float(start["mean"])
            self.m2 = float(start["std"]) ** 2 * self.count

    def __call__(self, values: Sequence[float], failed: Sequence[int] = ()) -> list[float]:
        out = list(values)
        skipped = set(failed)
        if self.normalize and out:
            for row, x in enumerate(out):
                if row not in skipped:
                    self.count += 1
                    delta = x - self.mean
                    self.mean += delta / self.count
                    self.m2 += delta * (x - self.mean)
            std = (self.m2 / self.count) ** 0.5 if self.count > 1 else 0.0
            out = [0.0 if row in skipped else (x - self.mean) / (std + 1e-8) for row, x in enumerate(out)]
        if self.clip is not None:
            out = [min(max(x, -self.clip), self.clip) for x in out]
        return out

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def learned_failure_line(source: str, row: int, value: RewardInput, reason: str) -> str:
    """One line naming a row a reward model or server failed: the source (its key and value), the row,
    the data row it answers (file and line), data_source, the reason, and what to do."""
    origin = f"{value.where}, " if value.where else ""
    return (f"{source}: row {row} ({origin}data_source {value.data_source}) was not scored: {reason}; fix it, or set "
            "reward.on_error=zero to score such rows 0 (counted in reward/errors)")


def _add_learned(scores: Scores, value: Any, failure: Optional[str], extras: Mapping[str, Any], on_error: str,
                 source: str, rows: Sequence[RewardInput]) -> None:
    """Append the next row of a learned part (`source`) to `scores`: `value` under `finite_score`
    unless `failure` says why it has none (its request failed). A failed row raises RewardError under
    on_error=raise, else scores 0.0 with no extras and is counted in `errors` and `failed`."""
    row = len(scores.values)
    if failure is None:
        try:
            scores.values.append(finite_score(value))
            scores.extras.append(dict(extras))
            return
        except ValueError as e:
            failure = f"it {e}"
    if on_error != "zero":
        raise RewardError(learned_failure_line(source, row, rows[row], failure))
    scores.values.append(0.0)
    scores.extras.append({})
    scores.errors += 1
    scores.failed.append(row)


class RewardModelScorer:
    """A reward model's scores: rows dealt in contiguous shares over the replicas of its worker group
    (`engine.reward_model.RewardModelEngine.score_texts`: each renders a row in its own template). A
    NaN or inf a model returns (an overflow in its dtype, a broken head) fails its row."""

    accuracy = Accuracy()

    def __init__(self, group: Any, on_error: str = "raise", path: str = ""):
        self.group, self.on_error, self.source = group, on_error, f"the reward model at reward.model.path={path}"

    def score(self, rows: Sequence[RewardInput]) -> Scores:
        from ppo_trainer.engine.reward_model import (
            RewardModelEngine,  # torch and transformers: with a reward model only
        )

        replicas = len(self.group)
        shares = [list(range(i * len(rows) // replicas, (i + 1) * len(rows) // replicas)) for i in range(replicas)]
        results = self.group.run_each(RewardModelEngine.score_texts, [([rows[i].messages for i in share],
                                                                       [rows[i].response for i in share])
                                                                      for share in shares])
        scores = Scores([], [])
        for value in (v for result in results for v in result):
            _add_learned(scores, value, None, {}, self.on_error, self.source, rows)
        return scores

    def close(self) -> None:
        """The group is the trainer's, closed with the others."""


def _extra(value: Any) -> Optional[float]:
    """A server's extra for one row as a float when it is a finite number (a bool counts, as in a
    function's extras), else None: null is missing, and text or a list has no mean to log."""
    if isinstance(value, (bool, int, float)) and math.isfinite(value):
        return float(value)
    return None


class RemoteScorer:
    """A reward server's scores (`rewards/remote.py`); a row whose request failed, or whose value is
    not a finite number (`finite_score`: NaN, Infinity, true, "0.5", null), goes through
    reward.on_error like a function's failed row. Extras keep their finite numbers only."""

    accuracy = Accuracy()

    def __init__(self, client: RemoteRewardClient, on_error: str):
        self.client, self.on_error = client, on_error

    def score(self, rows: Sequence[RewardInput]) -> Scores:
        answer = self.client.score({"query": [r.prompt + r.response for r in rows], "prompts": [r.prompt for r in rows],
                                    "labels": [r.ground_truth for r in rows],
                                    "data_sources": [r.data_source for r in rows],
                                    "extra_infos": [r.extra_info for r in rows], "messages": [r.messages for r in rows]})
        source = f"the reward server at reward.remote.url={redact_url(self.client.url)}"
        scores = Scores([], [])
        for row, (reward, failure) in enumerate(zip(answer.rewards, answer.failures)):
            extras = {name: _extra(values[row]) for name, values in answer.extras.items()}
            _add_learned(scores, reward, None if failure is None else str(failure),
                         {k: v for k, v in extras.items() if v is not None}, self.on_error, source, rows)
            scores.timeouts += int(failure is not None and failure.timed_out)
        return scores

    def close(self) -> None:
        """Nothing held between requests."""


@dataclass
class Part:
    """A learned part of the training score: its scorer, weight and normalisation."""

    name: str  # "model" or "remote": its raw scores are logged as reward/<name>/mean (and std)
    scorer: Scorer
    coef: float
    norm: RunningNorm


class NonFiniteStatistics(RewardError):
    """Running reward statistics that are not finite, found before a save would write them: the run
    stops (exit 1) and the last checkpoint stays as it was."""


def require_finite_scores(values: Sequence[float]) -> None:
    """The guard before the advantages: RewardError naming the rows whose training score is not
    finite (the scorers' rule makes them finite, so this is a bug to report, not a reward to fix)."""
    bad = [row for row, value in enumerate(values) if not math.isfinite(value)]
    if bad:
        raise RewardError(f"the training scores of rows {', '.join(map(str, bad))} are not finite "
                          f"({', '.join(str(values[row]) for row in bad)}) before the advantages; nothing was "
                          "updated with them. Please report this with the reward configuration")


class CombinedScorer:
    """The training score: reward.fn's score (if set) + reward.model.coef x the reward model's +
    reward.remote.coef x the server's, the learned parts each normalised and clipped as configured
    (a failed row's part adds 0). Each scored row's extras gain the learned parts' raw scores under
    "model" and "remote" (names a function's extras may not take). Validation accuracy follows the
    function, when there is one. `fingerprint`: the reward's `reward_fingerprint`, saved with the
    statistics so that a resume can tell a changed reward."""

    def __init__(self, function: Optional[Scorer], parts: Sequence[Part], fingerprint: Optional[dict[str, Any]] = None):
        self.function, self.parts, self.fingerprint = function, list(parts), fingerprint
        self.accuracy = function.accuracy if function is not None else Accuracy()

    def score(self, rows: Sequence[RewardInput]) -> Scores:
        total = self.function.score(rows) if self.function is not None else Scores([0.0] * len(rows),
                                                                                   [{} for _ in rows])
        for part in self.parts:
            raw = part.scorer.score(rows)
            for row, (value, extras) in enumerate(zip(part.norm(raw.values, raw.failed), raw.extras)):
                total.values[row] += part.coef * value
                raw_score = {} if row in raw.failed else {part.name: raw.values[row]}
                total.extras[row] = {**total.extras[row], **raw_score,
                                     **{f"{part.name}/{k}": v for k, v in extras.items()}}
            total.errors += raw.errors
            total.timeouts += raw.timeouts
        return total

    def raw(self) -> "CombinedScorer":
        """The same parts without normalisation or clipping (validation's score when no function
        judges: it must not move the running statistics training normalises by)."""
        return CombinedScorer(self.function, [Part(p.name, p.scorer, p.coef, RunningNorm(False, None)) for p in self.parts])

    def state_dict(self) -> dict[str, Any]:
        return {part.name: part.norm.state_dict() for part in self.parts}

    def saved_state(self, step: int, last_checkpoint: Callable[[], str]) -> dict[str, Any]:
        """What the trainer state holds of the reward: {"reward_norm": `state_dict`, "reward_fingerprint"},
        checked first: NonFiniteStatistics naming each statistic that is not finite, the step and
        `last_checkpoint()` (a checkpoint holding them could not be resumed). Finite scores overflow
        the statistics only when they are huge (around 1e154 and beyond)."""
        state = self.state_dict()
        bad = nonfinite_statistics(state)
        if bad:
            shown = ", ".join(f"{key} = {value}" for key, value in bad.items())
            raise NonFiniteStatistics(f"step {step} was not saved: the running reward statistics {shown} are not "
                                      "finite (scores this large overflow them); scale the reward down at its source; "
                                      f"{last_checkpoint()}")
        return {"reward_norm": state, "reward_fingerprint": self.fingerprint}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for part in self.parts:
            if part.name in state:
                part.norm.load_state_dict(state[part.name])

    def close(self) -> None:
        for scorer in (self.function, *(part.scorer for part in self.parts)):
            if scorer is not None:
                scorer.close()


def reward_fingerprint(cfg: Any) -> dict[str, Optional[str]]:
    """What a resume compares to tell whether the reward changed since a checkpoint: reward.fn and
    eval.reward_fn as their reference and the sha256 of their file's content (a module path: the
    module's file), reward.model.path, and reward.remote.url with its credentials masked."""
    return {"reward.fn": _function_fingerprint(cfg.reward.fn),
            "eval.reward_fn": _function_fingerprint(cfg.eval.reward_fn), "reward.model.path": cfg.reward.model.path,
            "reward.remote.url": redact_url(cfg.reward.remote.url) if cfg.reward.remote.url else None}


def _function_fingerprint(ref: Optional[str]) -> Optional[str]:
    """`ref` made absolute, with the first 16 hex digits of its file's sha256 when the file is found."""
    if ref is None:
        return None
    target = ref.rpartition(":")[0]
    try:
        origin = (target if target.endswith(".py") or "/" in target
                  else getattr(importlib.util.find_spec(target), "origin", None))
        digest = hashlib.sha256(Path(origin).expanduser().read_bytes()).hexdigest()[:16] if origin else None
    except (ImportError, ValueError, OSError):  # not found: building the scorer names the problem
        digest = None
    return f"{absolute_ref(ref)} (sha256 {digest})" if digest else absolute_ref(ref)


def build_training_scorer(cfg: Any, function: Optional[Scorer], reward_model: Any = None) -> CombinedScorer:
    """reward.fn's scorer (`build_scorer`, None without a function) with the reward model (its
    worker group) and the reward server of `cfg.reward`, as configured, and the reward's fingerprint."""
    r = cfg.reward
    parts = []
    if r.model.path:
        parts.append(Part("model", RewardModelScorer(reward_model, r.on_error, r.model.path), r.model.coef,
                          RunningNorm(r.model.normalize, r.model.clip, normalization_start(r.model))))
    if r.remote.url:
        client = RemoteRewardClient(r.remote.url, token=bearer_token(r.remote.token), batch_size=r.remote.batch_size,
                                    concurrency=r.remote.concurrency, timeout_s=r.remote.timeout_s,
                                    retries=r.remote.retries, use_proxy=r.remote.use_proxy)
        parts.append(Part("remote", RemoteScorer(client, r.on_error), r.remote.coef,
                          RunningNorm(r.remote.normalize, r.remote.clip)))
    return CombinedScorer(function, parts, reward_fingerprint(cfg))


def normalization_start(model: Any) -> Optional[dict[str, float]]:
    """The statistics a normalised reward model's running normalisation starts from: the mean, std and
    count of its scores on its training pairs, where its folder (reward.model.path) holds the
    score_stats.json that ppo-train-rm writes; None otherwise (it starts from the first batch). A
    resume whose reward model is unchanged continues the checkpoint's statistics instead; a changed
    one starts from the new model's (run/resume.py REWARD_RESETS)."""
    folder = Path(model.path).expanduser()
    if not model.normalize or not folder.is_dir():
        return None
    try:
        stats = read_score_stats(folder)
    except ValueError as e:
        raise RewardError(f"reward.model.path: {e}") from None
    if stats is not None:
        log.info("reward model: its score normalisation starts from %s (mean %.4g, std %.4g over %d scores)",
                 folder / SCORE_STATS, stats["mean"], stats["std"], stats["count"])
    return stats


def function_scorers(cfg: Any) -> tuple[Optional[Scorer], Optional[Scorer]]:
    """(reward.fn's scorer, eval.reward_fn's), each None where its key is null."""
    function = build_scorer(cfg.reward)
    try:
        return function, build_scorer(OmegaConf.merge(cfg.reward, {"fn": cfg.eval.reward_fn}), "eval.reward_fn")
    except BaseException:
        if function is not None:
            function.close()
        raise


def scorers_of(cfg: Any, groups: Mapping[str, Any],
               functions: Optional[tuple[Optional[Scorer], Optional[Scorer]]] = None) -> tuple[CombinedScorer, Scorer]:
    """A run's scorers from its worker groups (the reward model's, when there is one): (training's
    scorer: reward.fn with the reward model and server; validation's: eval.reward_fn,
    else reward.fn, else training's learned parts unnormalised), from `function_scorers` (made here
    unless given)."""
    function, validation = functions or function_scorers(cfg)
    training = build_training_scorer(cfg, function, groups.get("reward_model"))
    return training, validation or function or training.raw()
