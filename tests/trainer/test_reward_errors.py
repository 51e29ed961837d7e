"""A reward function that raises stops the run naming the row, the response and the error, or
(reward.on_error=zero) scores 0 and is counted."""

from __future__ import annotations

import json

import pytest

from ppo_trainer.cli import train_main


def test_raising_reward_stops_with_row_response_and_error(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "reliability_raising_reward.py").write_text(
        "def reward(response, ground_truth):\n    raise ValueError('cannot parse ' + ground_truth)\n")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train_main(["+experiment=smoke", f"trainer.output_dir={out}", "trainer.loggers=[jsonl]",
                    "reward.fn=reliability_raising_reward:reward"])
    assert exit_info.value.code == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "row 0" in line and "response" in line and "ValueError: cannot parse" in line
    assert not (out / "checkpoints").exists()


def test_reward_errors_can_score_zero_and_be_counted(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "reliability_zero_reward.py").write_text("def reward(response, ground_truth):\n    raise ValueError('x')\n")
    out = tmp_path / "run"
    train_main(["+experiment=smoke", f"trainer.output_dir={out}", "trainer.loggers=[jsonl]",
                "reward.fn=reliability_zero_reward:reward", "reward.on_error=zero", "trainer.total_steps=1"])
    step1 = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert step1["reward/errors"] == 8 and step1["critic/score/mean"] == 0
