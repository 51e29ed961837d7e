"""`SystemExit` from reward code: raised while importing it (a module or file that calls sys.exit at
import), it is a config error naming reward.fn, exit 2, in the driver and in reward workers;
raised during a call, it fails that row, and the driver or worker goes on."""

from __future__ import annotations

import os

import pytest

from ppo_trainer.config.schema import ConfigError, RewardConfig
from ppo_trainer.rewards.calling import Calling, Failure, RewardError, RewardInput, call, import_reward
from ppo_trainer.rewards.scoring import build_scorer

EXITING = "import sys\nsys.exit(0)\n\ndef score(response, ground_truth):\n    return 1.0\n"


def exiting_in_workers(driver_pid: int) -> str:
    """A reward file that imports in the driver (pid `driver_pid`) but calls sys.exit(0) in any other process."""
    return (f"import os, sys\nif os.getpid() != {driver_pid}:\n    sys.exit(0)\n\n"
            "def score(response, ground_truth):\n    return 1.0\n")


EXITING_CALLS = """
import sys

def score(response, ground_truth):
    if response == "exit":
        sys.exit(3)
    if response == "interrupt":
        raise KeyboardInterrupt
    return 1.0
"""


def rows(*responses: str) -> list[RewardInput]:
    return [RewardInput(r, "1", "src", None, "prompt", where=f"t.jsonl:{i + 1}") for i, r in enumerate(responses)]


# --- at import


def test_import_reward_turns_sys_exit_in_a_module_or_file_into_an_import_error(tmp_path, monkeypatch):
    (tmp_path / "exiting_module.py").write_text(EXITING)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"^importing module 'exiting_module' failed: SystemExit \(code 0\);"):
        import_reward("exiting_module:score")
    path = tmp_path / "exiting_file.py"
    path.write_text(EXITING)
    with pytest.raises(ImportError, match=rf"^executing {path} failed: SystemExit \(code 0\);"):
        import_reward(f"{path}:score")


def test_ppo_train_stops_with_exit_2_naming_reward_fn_when_its_module_calls_sys_exit(ppo_train_error, tmp_path,
                                                                                       no_model_loading):
    path = tmp_path / "exiting.py"
    path.write_text(EXITING)
    line = ppo_train_error(f"reward.fn={path}:score")
    assert line == (f"ppo-train: config error: 'reward.fn' is '{path}:score', but executing {path} failed: "
                    "SystemExit (code 0); fix the file")


def test_ppo_train_stops_with_exit_2_naming_reward_fn_when_it_exits_in_the_reward_workers(ppo_train_error, tmp_path,
                                                                                             no_model_loading):
    path = tmp_path / "exiting_in_workers.py"
    path.write_text(exiting_in_workers(os.getpid()))
    line = ppo_train_error(f"reward.fn={path}:score", "reward.num_workers=1")
    assert line == (f"ppo-train: config error: 'reward.fn' is '{path}:score', but a reward worker could not load it: "
                    f"ImportError: executing {path} failed: SystemExit (code 0); fix the file")


def test_a_reward_worker_that_cannot_import_the_function_is_a_config_error_naming_the_key(tmp_path):
    path = tmp_path / "exiting_in_workers.py"
    path.write_text(exiting_in_workers(os.getpid()))
    with pytest.raises(ConfigError, match=r"^'eval.reward_fn' is '.*exiting_in_workers.py:score', but a reward "
                                          r"worker could not load it: ImportError: executing"):
        build_scorer(RewardConfig(fn=f"{path}:score", num_workers=1), "eval.reward_fn")


# --- during a call


def test_sys_exit_during_a_call_in_the_driver_fails_that_row(tmp_path):
    path = tmp_path / "exiting_calls.py"
    path.write_text(EXITING_CALLS)
    fn = import_reward(f"{path}:score")
    assert call(fn, Calling("pair"), rows("exit")) == [Failure("SystemExit (code 3)")]
    scores = build_scorer(RewardConfig(fn=f"{path}:score", on_error="zero")).score(rows("ok", "exit", "ok"))
    assert (scores.values, scores.errors) == ([1.0, 0.0, 1.0], 1)
    failed = r"^reward function failed on row 0 \(t.jsonl:1, .*\): SystemExit \(code 3\); fix it"
    with pytest.raises(RewardError, match=failed):
        build_scorer(RewardConfig(fn=f"{path}:score")).score(rows("exit"))


def test_sys_exit_during_a_call_on_a_reward_worker_fails_that_row_and_the_worker_goes_on(tmp_path):
    path = tmp_path / "exiting_calls.py"
    path.write_text(EXITING_CALLS)
    scorer = build_scorer(RewardConfig(fn=f"{path}:score", num_workers=1, on_error="zero"))
    try:
        (worker,) = [w.process.pid for w in scorer.pool.workers]
        assert scorer.pool.map([rows("exit")]) == [[Failure("SystemExit (code 3)")]]
        scores = scorer.score(rows("ok", "exit", "ok"))
        assert (scores.values, scores.errors) == ([1.0, 0.0, 1.0], 1)
        assert [w.process.pid for w in scorer.pool.workers] == [worker]  # not replaced: it never died
    finally:
        scorer.close()


def test_a_keyboard_interrupt_during_a_call_is_not_a_failed_row(tmp_path):
    path = tmp_path / "exiting_calls.py"
    path.write_text(EXITING_CALLS)
    with pytest.raises(KeyboardInterrupt):
        call(import_reward(f"{path}:score"), Calling("pair"), rows("interrupt"))
