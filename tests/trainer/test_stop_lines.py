"""Every way a run stops after its models load ends with a line saying whether a checkpoint exists
and what a rerun does: a reward that fails mid-run (exit 1, one line), a config error only a
validation can find (exit 2, one line) and a failure nothing foresaw (exit 1, its traceback and
then that line)."""

from __future__ import annotations

import pytest

from ppo_trainer.cli import train_main

SMOKE = ["+experiment=smoke", "trainer.loggers=[jsonl]", "data.arithmetic.val_size=2", "trainer.save_every=1"]
SAVED = "the last complete checkpoint is run/checkpoints/global_step_1: rerun the same command to continue"


def test_a_reward_that_fails_after_a_save_stops_naming_the_last_complete_checkpoint(tmp_path, monkeypatch, capsys):
    """Validation of step 0 scores 2 responses, step 1 8; the 11th call is step 2's."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "stop_lines_late_reward.py").write_text(
        "calls = []\n\ndef reward(response, ground_truth):\n    calls.append(1)\n"
        "    if len(calls) > 10:\n        raise ValueError('the judge went away')\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        train_main([*SMOKE, "reward.fn=stop_lines_late_reward:reward", f"trainer.output_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("ppo-train: stopped: ") and "ValueError: the judge went away" in line
    assert line.endswith(f"; {SAVED}")


def test_a_config_error_a_validation_finds_after_a_save_names_the_last_complete_checkpoint(tmp_path, monkeypatch,
                                                                                           capsys):
    """reward.correct_score given to a function that returns its own `acc`: found when validation
    scores, here at step 2 of a run resumed from step 1."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "stop_lines_acc_reward.py").write_text(
        "def reward(response, ground_truth):\n    return {'score': 0.0, 'acc': False}\n")
    monkeypatch.chdir(tmp_path)
    train_main([*SMOKE, f"trainer.output_dir={tmp_path / 'run'}", "trainer.stop_after_steps=1"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train_main([*SMOKE, f"trainer.output_dir={tmp_path / 'run'}", "reward.fn=stop_lines_acc_reward:reward",
                    "reward.correct_score=0.5"])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("ppo-train: config error: 'reward.correct_score' is 0.5, but reward.fn returns 'acc'")
    assert line.endswith(f"; {SAVED}")


def test_an_unexpected_exception_mid_run_prints_its_traceback_then_the_last_complete_checkpoint(tmp_path, monkeypatch,
                                                                                              capsys):
    from ppo_trainer.trainer import Trainer

    train_step = Trainer.train_step

    def fails_at_step_2(self, step):
        if step == 2:
            raise ZeroDivisionError("a bug")
        return train_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", fails_at_step_2)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        train_main([*SMOKE, f"trainer.output_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback (most recent call last):" in err and "ZeroDivisionError: a bug" in err
    assert err[-1] == f"ppo-train: failed with an unexpected ZeroDivisionError (traceback above): {SAVED}"
