"""The one rule for learned and remote scores: a reward server's or a reward model's value that is not
a finite number (NaN, Infinity, a bool, text, null, a list) is a failed row under reward.on_error,
named and counted; the running normalisation leaves failed rows out and scores them 0; the trainer
refuses non-finite statistics and scores, and fingerprints the reward for a resume."""

from __future__ import annotations

import json
import math
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.rewards.calling import RewardError, RewardInput
from ppo_trainer.rewards.remote import RemoteRewardClient, RemoteRewardError, RemoteScores
from ppo_trainer.rewards.scoring import (
    CombinedScorer,
    Part,
    RemoteScorer,
    RunningNorm,
    build_training_scorer,
    require_finite_scores,
)
from ppo_trainer.run.resume import nonfinite_statistics


def rows(n: int) -> list[RewardInput]:
    return [RewardInput(f"r{i}", str(i), "arith", None, f"Q{i}? ", [{"role": "user", "content": f"Q{i}?"}],
                        f"data/train.jsonl:{i + 1}") for i in range(n)]


@pytest.fixture
def answering(serve_on_loopback) -> Callable[[str], str]:
    """A reward server on a free 127.0.0.1 port that answers every POST with the JSON text given."""

    def start(body: str) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        return serve_on_loopback(ThreadingHTTPServer(("127.0.0.1", 0), Handler))

    return start


class RawClient:
    """A client that hands the scorer raw per-row JSON values, as rewards/remote.py's client does."""

    url = "http://127.0.0.1:5000/get_reward"

    def __init__(self, *answers: RemoteScores):
        self.answers = list(answers)

    def score(self, request):
        return self.answers.pop(0)


class FakeRewardModel:
    """A reward model's worker group of one replica that returns fixed values."""

    def __init__(self, values):
        self.values = values

    def __len__(self):
        return 1

    def run_each(self, method, args):
        return [self.values]


def test_a_servers_nan_and_infinities_are_failed_rows_counted_under_on_error_zero(answering):
    url = answering('{"rewards": [NaN, Infinity, -Infinity, 0.25]}')
    scores = RemoteScorer(RemoteRewardClient(url, retries=0), "zero").score(rows(4))
    assert scores.values == [0.0, 0.0, 0.0, 0.25]
    assert scores.errors == 3 and scores.timeouts == 0 and scores.failed == [0, 1, 2]


def test_a_servers_nan_under_on_error_raise_names_the_server_row_data_row_and_value(answering):
    url = answering('{"rewards": [1.0, NaN]}')
    with pytest.raises(RewardError) as error:
        RemoteScorer(RemoteRewardClient(url, retries=0), "raise").score(rows(2))
    message = str(error.value)
    assert f"reward.remote.url={url}" in message and "row 1 (data/train.jsonl:2," in message
    assert "nan" in message and "reward.on_error=zero" in message


def test_raw_server_values_null_a_list_text_and_a_bool_fail_their_rows_and_extras_keep_only_numbers():
    raw = RemoteScores(rewards=[None, [1.0], "0.5", True, 2], failures=[None] * 5,
                       extras={"len": [3, None, float("nan"), "long", True], "note": ["a", "b", "c", "d", [1]]})
    scores = RemoteScorer(RawClient(raw), "zero").score(rows(5))
    assert scores.values == [0.0, 0.0, 0.0, 0.0, 2.0] and scores.errors == 4
    assert scores.extras[4] == {"len": 1.0}, "a bool extra counts as a number, text and lists are dropped"
    assert all(extras == {} for extras in scores.extras[:4]), "a failed row carries no extras"


def test_a_request_that_failed_fails_its_rows_and_a_timeout_is_counted():
    raw = RemoteScores(rewards=[None, None, 1.5], extras={},
                       failures=[RemoteRewardError("down", timed_out=True)] * 2 + [None])
    scores = RemoteScorer(RawClient(raw), "zero").score(rows(3))
    assert scores.values == [0.0, 0.0, 1.5] and (scores.errors, scores.timeouts, scores.failed) == (2, 2, [0, 1])


def reward_model_scorer(on_error: str, values):
    cfg = compose(["+experiment=smoke", "reward.fn=null", "reward.model.path=random:tiny-reward",
                   f"reward.on_error={on_error}"])
    return build_training_scorer(cfg, None, FakeRewardModel(values)).parts[0].scorer


def test_a_reward_models_nan_and_inf_are_failed_rows_counted_under_on_error_zero():
    scores = reward_model_scorer("zero", [0.5, float("nan"), float("inf"), -1.0]).score(rows(4))
    assert scores.values == [0.5, 0.0, 0.0, -1.0] and scores.errors == 2 and scores.failed == [1, 2]


def test_a_reward_models_inf_under_on_error_raise_names_the_model_row_and_data_row():
    with pytest.raises(RewardError) as error:
        reward_model_scorer("raise", [0.5, float("-inf")]).score(rows(2))
    message = str(error.value)
    assert "reward.model.path=random:tiny-reward" in message and "row 1 (data/train.jsonl:2," in message
    assert "-inf" in message and "reward.on_error=zero" in message


def test_the_running_normalisation_leaves_failed_rows_out_and_scores_them_zero():
    client = RawClient(RemoteScores(rewards=[1.0, float("nan"), 3.0], failures=[None] * 3),
                       RemoteScores(rewards=[5.0, None], failures=[None, RemoteRewardError("down")]))
    norm = RunningNorm(normalize=True, clip=None)
    scorer = CombinedScorer(None, [Part("remote", RemoteScorer(client, "zero"), 2.0, norm)])
    first = scorer.score(rows(3))  # 1 and 3 scored: mean 2, population std 1
    assert first.values == pytest.approx([2.0 * -1.0, 0.0, 2.0 * 1.0]) and first.errors == 1
    assert norm.state_dict() == {"count": 2, "mean": 2.0, "m2": 2.0}
    second = scorer.score(rows(2))  # 1, 3, 5 scored: mean 3, std sqrt(8/3)
    assert second.values == pytest.approx([2.0 * (5 - 3) / math.sqrt(8 / 3), 0.0])
    assert norm.state_dict() == {"count": 3, "mean": 3.0, "m2": 8.0}
    assert [e.get("remote") for e in first.extras] == [1.0, None, 3.0], "a failed row's raw score is not logged"


def test_a_first_batch_that_failed_entirely_trains_on_zeros_and_counts_nothing():
    norm = RunningNorm(normalize=True, clip=1.0)
    assert norm([0.0, 0.0], failed=[0, 1]) == [0.0, 0.0] and norm.state_dict() == {"count": 0, "mean": 0.0, "m2": 0.0}


def test_non_finite_statistics_are_named_by_their_key():
    state = {"model": {"count": 3, "mean": 1.0, "m2": 2.0},
             "remote": {"count": 3, "mean": float("nan"), "m2": float("inf")}}
    keys = ["reward_norm.remote.mean", "reward_norm.remote.m2"]
    assert list(nonfinite_statistics(state)) == keys
    assert list(nonfinite_statistics(json.loads(json.dumps(state)))) == keys, "as trainer.json holds them"
    assert nonfinite_statistics({"model": {"count": 3, "mean": "0.5", "m2": True}}) == {
        "reward_norm.model.mean": "0.5", "reward_norm.model.m2": True}


def test_scores_that_are_not_finite_before_the_advantages_raise_naming_the_rows():
    require_finite_scores([0.0, 1.5, -2.0])
    with pytest.raises(RewardError, match=r"rows 1, 3 .*\(nan, inf\)"):
        require_finite_scores([0.0, float("nan"), 1.0, float("inf")])
