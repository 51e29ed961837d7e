"""A newcomer's run from `ppo-train` to `ppo-eval`, as typed in a shell: data files and a reward
file named relative to the folder the run starts in; the run folder keeps the command and the
summary; the summary's `ppo-eval` command works from any other folder and writes into the run's
eval/ folder; the same command after the run finished prints the summary and loads no model."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[2]
REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return len(solution_str) % 3 / 2\n"
ARGV = ["+experiment=smoke", "trainer.total_steps=2", "trainer.val_every=2", "trainer.save_every=0",
        "trainer.loggers=[jsonl]", "data.train_files=[data/train.jsonl]", "data.val_files=[data/val.jsonl]",
        "reward.fn=rewards.py:compute_score", "trainer.output_dir=run"]
TRAIN = "import sys; from ppo_trainer.cli import train_main; train_main(sys.argv[1:])"
EVAL = "import sys; from ppo_trainer.cli import eval_main; eval_main(sys.argv[1:])"
NO_WORKERS = ("import ppo_trainer.workers.group as group\n"
              "def refuse(*args, **kwargs):\n    raise SystemExit('the workers were built')\n"
              "group.build_groups = refuse\n")


def python(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def summary_block(stdout: str) -> str:
    return stdout[stdout.index("run finished"):].rstrip("\n")


@pytest.fixture(scope="module")
def journey(tmp_path_factory) -> tuple[Path, str]:
    """The folder the run started in (data/, rewards.py, run/) and what `ppo-train` printed."""
    start = tmp_path_factory.mktemp("start")
    (start / "data").mkdir()
    for split, count in (("train", 16), ("val", 4)):
        rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(count)]
        (start / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (start / "rewards.py").write_text(REWARD)
    result = python(TRAIN, *ARGV, cwd=start)
    assert result.returncode == 0, result.stderr[-3000:]
    return start, result.stdout


@pytest.fixture(scope="module")
def evaluated(journey, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    """The summary's `ppo-eval` command, run as printed from a folder that is not the run's."""
    start, stdout = journey
    line = next(line for line in stdout.splitlines() if line.lstrip().startswith("evaluate "))
    command = shlex.split(line.partition(":")[2])
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    return python(EVAL, *command[1:], cwd=elsewhere), elsewhere, command


def test_the_saved_config_names_the_data_and_the_reward_file_absolute(journey):
    start, _ = journey
    for saved in (start / "run" / "config.yaml", start / "run" / "checkpoints" / "global_step_2" / "state" / "config.yaml"):
        cfg = OmegaConf.load(saved)
        assert list(cfg.data.train_files) == [str(start / "data" / "train.jsonl")]
        assert list(cfg.data.val_files) == [str(start / "data" / "val.jsonl")]
        assert cfg.reward.fn == f"{start / 'rewards.py'}:compute_score"


def test_the_summarys_ppo_eval_command_names_the_reward_file_and_runs_from_another_folder(journey, evaluated):
    start, _ = journey
    result, _, command = evaluated
    assert command == ["ppo-eval", f"model.path={start / 'run' / 'checkpoints' / 'global_step_2'}",
                       f"reward.fn={start / 'rewards.py'}:compute_score"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ppo-eval: accuracy" in result.stdout


def test_ppo_eval_of_a_checkpoint_writes_into_the_runs_eval_folder_not_the_current_one(journey, evaluated):
    start, _ = journey
    result, elsewhere, _ = evaluated
    written = start / "run" / "eval" / "global_step_2.jsonl"
    assert f"responses in {written}" in result.stdout
    assert len(written.read_text().splitlines()) == 4  # data/val.jsonl's 4 problems
    assert list(elsewhere.iterdir()) == []
    assert not list((start / "run" / "checkpoints").rglob("*.jsonl"))


def test_the_run_folder_keeps_the_command_as_typed_and_the_summary_as_printed(journey):
    start, stdout = journey
    assert (start / "run" / "command.txt").read_text() == shlex.join(["ppo-train", *ARGV]) + "\n"
    assert (start / "run" / "summary.txt").read_text() == summary_block(stdout) + "\n"


def test_the_same_command_after_the_run_finished_prints_its_summary_and_builds_no_worker(journey):
    start, stdout = journey
    result = python(NO_WORKERS + TRAIN, *ARGV, cwd=start)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary_block(stdout) in result.stdout
    assert "already finished" in result.stdout and "raise trainer.total_steps" in result.stdout
    assert "changed since" not in result.stderr  # the relative paths typed equal the absolute ones saved


def test_a_saved_path_that_is_gone_is_named_with_the_runs_config_it_came_from(journey, tmp_path):
    from ppo_trainer.cli import run_eval
    from ppo_trainer.config.schema import ConfigError

    start, _ = journey
    moved = tmp_path / "data"
    shutil.move(start / "data", moved)
    try:
        with pytest.raises(ConfigError, match=rf"data.val_files: {start / 'data' / 'val.jsonl'} does not exist; it "
                                              rf"came from the run's config \({start / 'run'}/checkpoints/global_step_2/"
                                              r"state/config.yaml\).*pass data.val_files="):
            run_eval([f"model.path={start / 'run'}", f"reward.fn={start / 'rewards.py'}:compute_score"])
    finally:
        shutil.move(moved, start / "data")
