"""The console of a run: engine output into engine.log, the run's own lines on the terminal, and a
second Ctrl-C as one line naming the last complete checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppo_trainer.cli import train_main
from ppo_trainer.console import engine_output_to_file

REPO_ROOT = Path(__file__).resolve().parents[1]


ENGINE_CHATTER = """
import logging, os, subprocess, sys, warnings
from pathlib import Path
from ppo_trainer.console import console_stream, engine_output_to_file
logging.basicConfig(level=logging.INFO, format="%(message)s")
with engine_output_to_file(Path(sys.argv[1])):
    os.write(2, b"C++ warning on fd 2\\n")  # what torch and oneDNN print, below Python
    print("a loader's progress bar on stdout")
    warnings.warn("a Python warning")
    logging.getLogger("vllm.demo").warning("engine chatter")
    subprocess.run([sys.executable, "-c", "print('a child process')"])
    print("step 1/2  score 0.500", file=console_stream())
    logging.getLogger("ppo_trainer").warning("saved step 1")
print("after the run")
"""


def test_engine_output_goes_to_engine_log_and_the_runs_lines_to_the_terminal(tmp_path):
    log_path = tmp_path / "run" / "engine.log"
    result = subprocess.run([sys.executable, "-c", ENGINE_CHATTER, str(log_path)], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "step 1/2  score 0.500\nafter the run\n"
    assert result.stderr == "saved step 1\n"
    text = log_path.read_text()
    for line in ("C++ warning on fd 2", "a loader's progress bar on stdout", "a Python warning", "engine chatter",
                 "a child process", "saved step 1"):
        assert line in text
    assert "step 1/2" not in text


def test_verbose_leaves_the_output_on_the_terminal_and_writes_no_engine_log(tmp_path, capfd):
    with engine_output_to_file(tmp_path / "engine.log", verbose=True):
        os.write(2, b"C++ warning\n")
    assert capfd.readouterr().err == "C++ warning\n"
    assert not (tmp_path / "engine.log").exists()


def test_second_ctrl_c_ends_with_one_line_naming_the_last_complete_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    (out / "checkpoints" / "global_step_4").mkdir(parents=True)
    (out / "checkpoints" / "global_step_6").mkdir()  # a step of an abandoned run: latest names step 4
    (out / "checkpoints" / "latest").write_text("global_step_4\n")

    def interrupted(*_args):
        raise KeyboardInterrupt  # what the trainer's handler raises on the second SIGINT

    monkeypatch.setattr("ppo_trainer.trainer.run_training", interrupted)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        train_main(["+experiment=smoke", f"trainer.output_dir={out}"])
    assert exit_info.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ppo-train: interrupted; the last complete checkpoint is out/checkpoints/global_step_4: "
                   "rerun the same command to continue"]


def test_a_smoke_run_shows_only_its_own_lines_and_ends_with_the_block(tmp_path):
    code = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])"
    result = subprocess.run([sys.executable, "-c", code, "+experiment=smoke", "trainer.total_steps=1",
                             f"trainer.output_dir={tmp_path / 'run'}", "trainer.loggers=[console,jsonl]"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr
    assert "step 1/1" in result.stdout
    assert "evaluate best:" in result.stdout  # the end-of-run block reaches the terminal
    engine_log = (tmp_path / "run" / "engine.log")
    assert not engine_log.exists() or "evaluate best:" not in engine_log.read_text()
    own = ("step ", "PPO ", "dtypes:", "model ", "data:", "eval:", "saved ", "run ", "  ")
    strays = [line for line in (result.stdout + result.stderr).splitlines() if line and not line.startswith(own)]
    assert strays == [], strays
    assert "model random:tiny is randomly initialised: this run checks the plumbing" in result.stderr


def start_lines(monkeypatch, tmp_path, *overrides: str) -> list[str]:
    """What `ppo-train` gives the run to say when it starts (the run itself stubbed out)."""
    given: list[str] = []
    monkeypatch.setattr("ppo_trainer.trainer.run_training", lambda cfg, command, lines: given.extend(lines))
    monkeypatch.chdir(tmp_path)
    train_main([*overrides, f"trainer.output_dir={tmp_path / 'run'}"])
    return given


def test_smoke_says_at_start_that_its_random_model_checks_the_plumbing_not_learning(monkeypatch, tmp_path):
    assert ("model random:tiny is randomly initialised: this run checks the plumbing (every phase, checkpoints, "
            "resume), not learning; a score and val/accuracy of 0 are expected, also from a miswired reward. A run "
            "that learns: +experiment=digits (docs/learning.md)") in start_lines(monkeypatch, tmp_path, "+experiment=smoke")
    digits = start_lines(monkeypatch, tmp_path, "+experiment=digits")  # the same random model learns this
    assert not [line for line in digits if "randomly initialised" in line]


def test_a_remote_reward_is_named_at_start_with_its_url_and_the_reward_model(monkeypatch, tmp_path):
    import threading

    from ppo_trainer.rewards.serving import function_scorer
    from ppo_trainer.serve_reward import make_server

    server = make_server(function_scorer("ppo_trainer.rewards.math:score"), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
    try:
        lines = start_lines(monkeypatch, tmp_path, "+experiment=smoke", "reward.fn=null",
                            f"reward.remote.url={url}", "reward.remote.coef=0.5", "reward.model.path=random:tiny-reward",
                            "eval.reward_fn=ppo_trainer.rewards.math:score")
    finally:
        server.shutdown()
        server.server_close()
    (line,) = [line for line in lines if line.startswith("reward: ")]
    assert line.startswith("reward: 1 x reward model random:tiny-reward (")
    assert line.endswith(f" + 0.5 x reward server {url}; validation accuracy by ppo_trainer.rewards.math:score")
