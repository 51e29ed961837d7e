"""Learned and remote scores in smoke runs, through `ppo-train` and a reward server on 127.0.0.1: a
server's NaN costs one row, not the run; statistics that are not finite are never saved (exit 1) nor
resumed (exit 2, with the ways out); a changed reward is printed on resume and restarts the
normalisation of the part it changes; no non-finite score reaches the advantages."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import pytest

from ppo_trainer.cli import train_main
from ppo_trainer.config.composition import compose
from ppo_trainer.rewards.calling import RewardError
from ppo_trainer.run import resume
from ppo_trainer.trainer import run_training

SMOKE = ["+experiment=smoke", "trainer.loggers=[jsonl]", "eval.reward_fn=ppo_trainer.rewards.math:score"]
REMOTE = ["reward.fn=null", "reward.remote.normalize=true", "reward.on_error=zero"]
REWARD_MODEL = ["reward.fn=null", "reward.model.path=random:tiny-reward", "reward.model.normalize=true"]
ROWS_PER_STEP = 4 * 2  # smoke: 4 prompts x 2 samples


def metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def saved_state(out: Path, step: int) -> dict:
    return json.loads((out / "checkpoints" / f"global_step_{step}" / "state" / "trainer.json").read_text())


def lengths(body: dict) -> list[float]:
    """A reward that varies: each response's length (its query less its prompt)."""
    return [len(query) - len(prompt) for query, prompt in zip(body["query"], body["prompts"])]


@pytest.fixture
def reward_server(serve_on_loopback) -> Callable[[Callable[[int, dict], str]], str]:
    """Starts servers on free 127.0.0.1 ports; `answer(n, body)` gives the JSON text of the n-th POST (1, 2, ...)."""

    def start(answer: Callable[[int, dict], str]) -> str:
        posts = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                posts.append(body)
                data = answer(len(posts), body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802  (a start probe)
                self.send_response(405)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        return serve_on_loopback(ThreadingHTTPServer(("127.0.0.1", 0), Handler))

    return start


def finite_everywhere(records: dict[int, dict]) -> bool:
    """No metric is NaN or inf (metrics.jsonl writes them as the strings "nan", "inf", "-inf")."""
    return all(math.isfinite(v) if isinstance(v, float) else str(v).lower() not in ("nan", "inf", "-inf")
               for r in records.values() for v in r.values())


def test_a_server_that_answers_nan_once_costs_one_row_and_the_same_command_continues(reward_server, tmp_path,
                                                                                      monkeypatch):
    """The issue's headline: NaN once, normalised, on_error=zero; Ctrl-C during that step, then the same command."""
    def answer(n: int, body: dict) -> str:
        rewards = lengths(body)
        if n == 2:  # step 2: one NaN, and Ctrl-C (the step finishes, saves and stops)
            rewards[3] = float("nan")
            os.kill(os.getpid(), signal.SIGINT)
        return json.dumps({"rewards": rewards})

    out = tmp_path / "run"
    command = [*SMOKE, *REMOTE, f"reward.remote.url={reward_server(answer)}", f"trainer.output_dir={out}"]
    monkeypatch.chdir(tmp_path)
    train_main(command)
    first = metrics(out)
    assert sorted(first) == [0, 1, 2] and [first[s]["reward/errors"] for s in (1, 2)] == [0, 1]
    assert finite_everywhere(first) and first[2]["actor/skipped_steps"] == first[2]["critic/skipped_steps"] == 0
    norm = saved_state(out, 2)["reward_norm"]["remote"]
    assert norm["count"] == 2 * ROWS_PER_STEP - 1 and all(math.isfinite(norm[k]) for k in ("mean", "m2"))
    train_main(command)  # "rerun the same command to continue"
    after = metrics(out)
    assert sorted(after) == [0, 1, 2, 3, 4] and finite_everywhere(after)
    assert all(after[s]["reward/errors"] == 0 and after[s]["actor/skipped_steps"] == 0 for s in (3, 4))
    assert saved_state(out, 4)["reward_norm"]["remote"]["count"] == 4 * ROWS_PER_STEP - 1


def test_statistics_that_overflow_stop_the_save_with_exit_1_naming_the_key_and_keep_the_last_checkpoint(
        reward_server, tmp_path, monkeypatch, capsys):
    def answer(n: int, body: dict) -> str:  # finite, but their squares overflow the running m2 at step 2
        huge = [(-1) ** i * 1e300 for i in range(len(body["query"]))]
        return json.dumps({"rewards": lengths(body) if n == 1 else huge})

    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        train_main([*SMOKE, *REMOTE, f"reward.remote.url={reward_server(answer)}", f"trainer.output_dir={out}",
                    "trainer.save_every=1"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "ppo-train: stopped: step 2 was not saved: the running reward statistics reward_norm.remote.m2 = inf" in err
    assert "the last complete checkpoint is run/checkpoints/global_step_1: rerun the same command to continue" in err
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["commit_order", "global_step_1", "latest"]
    assert (checkpoints / "latest").read_text().strip() == "global_step_1"
    assert saved_state(out, 1)["reward_norm"]["remote"]["count"] == ROWS_PER_STEP


def no_model_loading(*_args, **_kwargs):
    raise AssertionError("a model was about to load: the resume must be refused before")


def test_a_resume_from_non_finite_statistics_exits_2_naming_the_file_the_key_and_the_ways_out(tmp_path, monkeypatch,
                                                                                            capsys):
    out = tmp_path / "run"
    command = [*SMOKE, *REWARD_MODEL, f"trainer.output_dir={out}", "trainer.save_every=1"]
    monkeypatch.chdir(tmp_path)
    train_main([*command, "trainer.stop_after_steps=2"])
    state_file = out / "checkpoints" / "global_step_2" / "state" / "trainer.json"
    poisoned = json.loads(state_file.read_text())
    poisoned["reward_norm"]["model"]["mean"] = float("nan")
    state_file.write_text(json.dumps(poisoned))  # NaN, as an older version saved it

    with monkeypatch.context() as m:
        m.setattr("ppo_trainer.workers.group.build_groups", no_model_loading)
        with pytest.raises(SystemExit) as exit_info:
            train_main([*command, "trainer.stop_after_steps=3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (f"ppo-train: input error: {state_file}: reward_norm.model.mean is nan, not a finite number, so the reward "
            f"normalisation of step 2 cannot continue. Resume from step 1, whose statistics are finite, with "
            f"trainer.resume={out / 'checkpoints' / 'global_step_1'}; or keep this step") in err
    assert f"deleting 'model' from \"reward_norm\" in {state_file}" in err

    train_main([*command, "trainer.stop_after_steps=2",  # the first way out: the earlier step
                f"trainer.resume={out / 'checkpoints' / 'global_step_1'}"])
    assert saved_state(out, 2)["reward_norm"]["model"]["count"] == 2 * ROWS_PER_STEP

    state = json.loads(state_file.read_text())
    del state["reward_norm"]["model"]  # the second way out: this step, with the normalisation restarted
    state_file.write_text(json.dumps(state))
    train_main([*command, "trainer.stop_after_steps=3"])
    assert saved_state(out, 3)["reward_norm"]["model"]["count"] == ROWS_PER_STEP


def test_a_changed_reward_is_printed_on_resume_and_restarts_only_the_changed_parts_statistics(reward_server, tmp_path,
                                                                                             caplog):
    judge = tmp_path / "judge.py"
    judge.write_text("def compute_score(data_source, solution_str, ground_truth):\n    return 0.0\n")
    first_url = reward_server(lambda n, body: json.dumps({"rewards": lengths(body)}))
    both = [*SMOKE, *REWARD_MODEL, f"reward.fn={judge}:compute_score", "reward.remote.normalize=true",
            "trainer.save_every=1", f"trainer.output_dir={tmp_path / 'run'}"]
    run_training(compose([*both, f"reward.remote.url={first_url}", "trainer.stop_after_steps=2"]))
    before = saved_state(tmp_path / "run", 2)
    judge.write_text("def compute_score(data_source, solution_str, ground_truth):\n    return 1.0\n")
    second_url = reward_server(lambda n, body: json.dumps({"rewards": [-x for x in lengths(body)]}))
    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        run_training(compose([*both, f"reward.remote.url={second_url}", "trainer.stop_after_steps=3"]))
    changed = [m for m in caplog.messages if m.startswith("resume: the reward changed")]
    old_hash, new_hash = (s["reward_fingerprint"]["reward.fn"] for s in (before, saved_state(tmp_path / "run", 3)))
    assert old_hash != new_hash and old_hash.startswith(f"{judge}:compute_score (sha256 ")
    assert changed == [f"resume: the reward changed since step 2: reward.fn {old_hash} -> {new_hash}; nothing to reset "
                       "(a function's score is not normalised)",
                       f"resume: the reward changed since step 2: reward.remote.url {first_url} -> {second_url}; the "
                       "remote score's normalisation statistics start over"]
    after = saved_state(tmp_path / "run", 3)["reward_norm"]
    assert after["model"]["count"] == 3 * ROWS_PER_STEP, "the reward model did not change: its statistics go on"
    assert after["remote"]["count"] == ROWS_PER_STEP, "the server changed: its statistics start over"


def test_a_changed_reward_model_restarts_its_statistics_and_an_old_checkpoint_compares_nothing(caplog):
    before = {"reward.fn": None, "eval.reward_fn": None, "reward.model.path": "random:tiny-reward",
              "reward.remote.url": "http://***@127.0.0.1:5000/get_reward"}
    state = {"step": 7, "reward_fingerprint": before}
    with caplog.at_level(logging.INFO, logger="ppo_trainer"):
        assert resume.reset_reward_parts(state, {**before, "reward.model.path": "/models/rm-v2"}) == {"model"}
        assert resume.reset_reward_parts(state, before) == set()
        assert resume.reset_reward_parts({"step": 7}, {**before, "reward.model.path": "/models/rm-v2"}) == set()
    assert caplog.messages == ["resume: the reward changed since step 7: reward.model.path random:tiny-reward -> "
                               "/models/rm-v2; the model score's normalisation statistics start over"]


def test_a_non_finite_score_never_reaches_the_advantages(tmp_path, monkeypatch):
    from ppo_trainer.rewards import shaping

    penalties = shaping.penalties

    def poisoned(*args, **kwargs):  # a bug upstream of the advantages: row 5's score turns NaN
        out = dict(penalties(*args, **kwargs))
        nan_at_5 = (args[1] * 0.0).double()
        nan_at_5[5] = float("nan")
        return {**out, "truncation_penalty": nan_at_5}

    monkeypatch.setattr(shaping, "penalties", poisoned)
    with pytest.raises(RewardError, match=r"training scores of rows 5 are not finite \(nan\) before the advantages"):
        run_training(compose([*SMOKE, f"trainer.output_dir={tmp_path}", "trainer.total_steps=1"]))
    assert not (tmp_path / "checkpoints" / "latest").exists()
