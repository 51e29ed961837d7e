"""PPO against learned rewards in smoke runs: a reward model role (its own tokenizer and template),
a reward server, prompt-only data, validation by a rule apart from training's reward, and an exact
resume of the running normalisation."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.serve_reward import function_scorer, make_server
from ppo_trainer.trainer import run_training

SMOKE = ["+experiment=smoke", "trainer.loggers=[jsonl]", "trainer.total_steps=2", "trainer.save_every=0"]
REWARD_MODEL = ["reward.fn=null", "reward.model.path=random:tiny-reward"]


def metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_a_reward_model_scores_training_and_a_rule_validates(tmp_path):
    run_training(compose([*SMOKE, *REWARD_MODEL, "reward.model.coef=2.0", "eval.reward_fn=ppo_trainer.rewards.math:score",
                          f"trainer.output_dir={tmp_path}"]))
    step = metrics(tmp_path)[2]
    assert step["critic/score/mean"] == pytest.approx(2.0 * step["reward/model/mean"])
    assert "reward/model/std" in step and "perf/reward_model/max_memory_allocated_gb" in step
    rows = [json.loads(line) for line in (tmp_path / "val_generations" / "step_2.jsonl").read_text().splitlines()]
    assert all("model" not in row.get("extras", {}) for row in rows), "validation scored by the rule alone"


def test_prompt_only_data_trains_on_a_reward_model_and_needs_answers_for_a_function(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"Say a number near {i}."}]} for i in range(8)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = [f"data.train_files={data}", f"data.val_files={data}", "data.prompt_key=prompt"]
    run_training(compose([*SMOKE, *REWARD_MODEL, *files, f"trainer.output_dir={tmp_path / 'run'}"]))
    assert "reward/model/mean" in metrics(tmp_path / "run")[1]
    from ppo_trainer.data import DataError

    with pytest.raises(DataError, match="missing key 'answer'"):
        run_training(compose([*SMOKE, *files, f"trainer.output_dir={tmp_path / 'with_fn'}"]))


def test_a_reward_server_scores_training(tmp_path):
    (tmp_path / "length_judge.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth):\n    return len(solution_str) / 16\n")
    server = make_server(function_scorer(f"{tmp_path / 'length_judge.py'}:compute_score"), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
        run_training(compose([*SMOKE, "reward.fn=null", f"reward.remote.url={url}", "reward.remote.coef=0.5",
                              "eval.reward_fn=ppo_trainer.rewards.math:score", f"trainer.output_dir={tmp_path / 'run'}"]))
    finally:
        server.shutdown()
        server.server_close()
    step = metrics(tmp_path / "run")[1]
    assert step["reward/remote/mean"] > 0 and step["critic/score/mean"] == pytest.approx(0.5 * step["reward/remote/mean"])


def test_an_unreachable_reward_server_stops_the_run_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import socket

    from ppo_trainer.cli import train_main

    monkeypatch.setattr("ppo_trainer.workers.group.build_groups", pytest.fail)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/get_reward"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        train_main([*SMOKE, f"reward.remote.url={url}", f"trainer.output_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    assert f"reward.remote.url={url}: nothing answers" in capsys.readouterr().err


def test_a_resume_continues_the_reward_normalisation_exactly(tmp_path):
    normalised = [*REWARD_MODEL, "reward.model.normalize=true", "trainer.total_steps=4", "trainer.save_every=1"]
    run_training(compose([*SMOKE, *normalised, f"trainer.output_dir={tmp_path / 'once'}"]))
    resumed = tmp_path / "resumed"
    run_training(compose([*SMOKE, *normalised, f"trainer.output_dir={resumed}", "trainer.stop_after_steps=2"]))
    state = json.loads((resumed / "checkpoints" / "global_step_2" / "state" / "trainer.json").read_text())
    assert state["reward_norm"]["model"]["count"] == 2 * 4 * 2  # two steps of 4 prompts x 2 samples
    run_training(compose([*SMOKE, *normalised, f"trainer.output_dir={resumed}"]))
    expected, got = metrics(tmp_path / "once"), metrics(resumed)
    for step in (3, 4):
        keys = {k for k in expected[step] if not k.startswith(("timing_s/", "perf/"))}
        assert {k: got[step][k] for k in keys} == {k: expected[step][k] for k in keys}
