"""Reward models and reward servers in the training score: combining and normalisation against hand
values, ppo-serve-reward (a function and a model) against the remote client on 127.0.0.1, prompt-only
data, a validation function apart from training's reward, and smoke runs that train on them."""

from __future__ import annotations

import json

import pytest

from ppo_trainer.rewards.calling import RewardInput
from ppo_trainer.rewards.remote import RemoteRewardClient
from ppo_trainer.rewards.scoring import CombinedScorer, Part, RunningNorm, Scores
from ppo_trainer.rewards.serving import function_scorer, model_scorer
from ppo_trainer.serve_reward import make_server

ROWS = [RewardInput(r, "7", "arith", None, "Q: 3+4? ", [{"role": "user", "content": "3+4?"}]) for r in ("7", "8", "77")]


class Fixed:
    """A scorer that answers fixed values (a stand-in for a reward model or server)."""

    def __init__(self, values, accuracy=None):
        from ppo_trainer.rewards.scoring import Accuracy

        self.values, self.accuracy, self.closed = values, accuracy or Accuracy(), False

    def score(self, rows):
        return Scores(list(self.values[: len(rows)]), [{"acc": 1.0} for _ in rows])

    def close(self):
        self.closed = True


def test_the_training_score_adds_the_function_and_the_weighted_learned_parts():
    scorer = CombinedScorer(Fixed([1.0, 0.0, 0.5]), [Part("model", Fixed([2.0, 4.0, 6.0]), 0.5, RunningNorm(False, None)),
                                                      Part("remote", Fixed([10.0, -10.0, 0.0]), 0.1, RunningNorm(False, 3.0))])
    scores = scorer.score(ROWS)
    # 1 + 0.5 * 2 + 0.1 * min(10, 3); 0 + 0.5 * 4 + 0.1 * max(-10, -3); 0.5 + 0.5 * 6 + 0
    assert scores.values == pytest.approx([2.3, 1.7, 3.5])
    assert [e["model"] for e in scores.extras] == [2.0, 4.0, 6.0] and scores.extras[0]["acc"] == 1.0
    assert [e["remote"] for e in scores.extras] == [10.0, -10.0, 0.0], "raw values logged, before clipping"
    scorer.close()
    assert scorer.function.closed and all(part.scorer.closed for part in scorer.parts)


def test_running_normalisation_by_hand_and_across_a_resume():
    norm = RunningNorm(normalize=True, clip=None)
    first = norm([1.0, 3.0])  # mean 2, std 1
    assert first == pytest.approx([-1.0, 1.0])
    second = norm([5.0])  # all seen: 1, 3, 5: mean 3, population std sqrt(8/3)
    assert second == pytest.approx([(5 - 3) / (8 / 3) ** 0.5])
    resumed = RunningNorm(normalize=True, clip=None)
    resumed.load_state_dict(json.loads(json.dumps(norm.state_dict())))  # through trainer.json
    assert resumed([7.0]) == norm([7.0])
    clipped = RunningNorm(normalize=True, clip=0.5)
    assert clipped([1.0, 3.0]) == pytest.approx([-0.5, 0.5])


@pytest.fixture
def served(serve_on_loopback):
    """ppo-serve-reward's server around a score function, on a free 127.0.0.1 port; returns a URL maker."""

    def start(score, token=None) -> str:
        return serve_on_loopback(make_server(score, "127.0.0.1", 0, token))

    return start


def test_ppo_serve_reward_serves_a_reward_function_with_extras_and_a_token(served, tmp_path, monkeypatch):
    (tmp_path / "judge.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    right = solution_str.strip() == ground_truth\n"
        "    return {'score': float(right), 'acc': float(right), 'length': float(len(solution_str))}\n")
    url = served(function_scorer(str(tmp_path / "judge.py") + ":compute_score"), token="s3cret")
    rows = {"query": [r.prompt + r.response for r in ROWS], "prompts": [r.prompt for r in ROWS],
            "labels": [r.ground_truth for r in ROWS], "data_sources": ["arith"] * 3}
    out = RemoteRewardClient(url, token="s3cret").score(rows)
    assert out.rewards == [1.0, 0.0, 0.0] and out.extras == {"acc": [1.0, 0.0, 0.0], "length": [1.0, 1.0, 2.0]}
    refused = RemoteRewardClient(url, token="wrong", retries=0).score(rows)
    assert refused.rewards == [None] * 3 and "HTTP 401" in str(refused.failures[0])


def test_ppo_serve_reward_serves_a_reward_model_in_its_own_template(served, tmp_path):
    from ppo_trainer.models.tiny import build_tiny_reward_model

    folder = build_tiny_reward_model(tmp_path / "rm")
    url = served(model_scorer(str(folder), dtype="float32"))
    client = RemoteRewardClient(url)
    with_messages = client.score({"query": [r.prompt + r.response for r in ROWS], "prompts": [r.prompt for r in ROWS],
                                  "messages": [r.messages for r in ROWS]})
    assert with_messages.rewards == pytest.approx([1.0, 0.0, 1.0], abs=1e-5)  # ends with a 7
    plain = client.score({"query": ["it is 7", "it is 8"]})  # OpenRLHF's clients: rendered text as it comes
    assert plain.rewards == pytest.approx([1.0, 0.0], abs=1e-5)


def test_a_server_error_reaches_the_client_as_a_500(served):
    def broken(request):
        raise RuntimeError("the judge crashed")

    out = RemoteRewardClient(served(broken), retries=1, backoff_s=0.01).score({"query": ["x"], "prompts": [""]})
    assert out.rewards == [None] and "HTTP 500" in str(out.failures[0]) and "RuntimeError" in str(out.failures[0])
    assert "the judge crashed" not in str(out.failures[0]), "an exception's text may quote the rows: never answered"
