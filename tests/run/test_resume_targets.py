"""What `trainer.resume=PATH` may name, as ppo-eval takes them: a `global_step_N` folder, a
`checkpoints/latest` or `checkpoints/best` pointer (the step it names), or a run folder (its latest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_trainer.run import checkpoint


def fabricated_run(output_dir: Path, steps: tuple[int, ...], best: int) -> Path:
    """Step folders holding the driver's state file, and the `latest` and `best` pointers."""
    for step in steps:
        state = checkpoint.step_dir(output_dir, step) / "state"
        state.mkdir(parents=True)
        (state / "trainer.json").write_text(json.dumps({"step": step}))
    checkpoint.write_pointer(output_dir, "latest", steps[-1])
    checkpoint.write_pointer(output_dir, "best", best)
    return output_dir


@pytest.mark.parametrize("pointer, step", [("latest", 4), ("best", 2)])
def test_resume_from_a_pointer_resumes_the_step_it_names(tmp_path, pointer, step):
    run = fabricated_run(tmp_path / "run", (2, 4), best=2)
    target = checkpoint.resolve_resume(tmp_path / "new", str(run / "checkpoints" / pointer))
    assert target == run / "checkpoints" / f"global_step_{step}"


def test_resume_from_a_run_folder_resumes_its_latest_checkpoint(tmp_path, monkeypatch):
    fabricated_run(tmp_path / "run", (2, 4), best=2)
    monkeypatch.chdir(tmp_path)
    assert checkpoint.resolve_resume(tmp_path / "new", "run") == tmp_path / "run" / "checkpoints" / "global_step_4"


def test_resume_from_a_pointer_naming_a_deleted_step_names_the_pointer_and_the_steps_left(tmp_path):
    run = fabricated_run(tmp_path / "run", (2,), best=2)
    (run / "checkpoints" / "latest").write_text("global_step_6\n")
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoints/latest names 'global_step_6', which is not a "
                                                          r"checkpoint folder; resume from one that exists"):
        checkpoint.resolve_resume(tmp_path / "new", str(run / "checkpoints" / "latest"))


def test_resume_from_a_run_folder_without_checkpoints_says_so(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(checkpoint.CheckpointError, match=r"trainer.resume=.*run: the run holds no checkpoint yet"):
        checkpoint.resolve_resume(tmp_path / "new", str(tmp_path / "run"))
