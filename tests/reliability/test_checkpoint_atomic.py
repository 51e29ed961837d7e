"""Atomic checkpoints: a half-written step is never resumed from; rotation keeps the newest and
the best."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppo_trainer import checkpoint


def write_step(output_dir: Path, step: int, keep_last: int = 2, best: bool = False) -> Path:
    staging = checkpoint.begin(output_dir, step)
    for role in ("actor", "critic"):
        (staging / "state" / role).mkdir(parents=True)
    checkpoint.save_trainer_state(staging / "state", {"step": step, "loader": {}, "kl_ctrl": {}},
                                  {"torch": torch.get_rng_state()})
    return checkpoint.commit(output_dir, step, keep_last, best=best)


def test_latest_names_the_last_committed_step(tmp_path):
    write_step(tmp_path, 1)
    write_step(tmp_path, 2)
    assert checkpoint.resolve_resume(tmp_path, "auto") == tmp_path / "checkpoints" / "global_step_2"


def test_a_half_written_step_is_never_resumed_and_is_cleaned_up(tmp_path):
    write_step(tmp_path, 2)
    crashed = checkpoint.begin(tmp_path, 4)  # a crash while writing step 4: never committed
    (crashed / "partial.bin").write_bytes(b"\0" * 10)
    assert checkpoint.resolve_resume(tmp_path, "auto").name == "global_step_2"
    assert checkpoint.complete_steps(tmp_path) == [2]
    write_step(tmp_path, 3)
    assert not crashed.exists(), "leftover staging folders are removed at the next commit"


def test_rotation_keeps_the_newest_keep_last(tmp_path):
    for step in range(1, 6):
        write_step(tmp_path, step, keep_last=2)
    assert checkpoint.complete_steps(tmp_path) == [4, 5]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step_5"


def test_rotation_keeps_the_step_best_names(tmp_path):
    for step in range(1, 6):
        write_step(tmp_path, step, keep_last=1, best=step == 2)
    assert checkpoint.complete_steps(tmp_path) == [2, 5]
    assert checkpoint.read_pointer(tmp_path / "checkpoints" / "best") == tmp_path / "checkpoints" / "global_step_2"
    write_step(tmp_path, 6, keep_last=1, best=True)  # a new best: the old one may go
    assert checkpoint.complete_steps(tmp_path) == [6]


def test_resume_never_and_explicit_path(tmp_path):
    folder = write_step(tmp_path, 1)
    assert checkpoint.resolve_resume(tmp_path, "never") is None
    assert checkpoint.resolve_resume(tmp_path, str(folder)) == folder


def test_rng_state_loads_with_weights_only(tmp_path):
    folder = write_step(tmp_path, 1)
    state, rng = checkpoint.load_trainer_state(folder / "state")
    assert state["step"] == 1 and torch.equal(rng["torch"], torch.get_rng_state())


def test_truncated_trainer_state_is_reported_as_corrupt(tmp_path):
    folder = write_step(tmp_path, 1)
    (folder / "state" / "rng.pt").write_bytes(b"garbage")
    with pytest.raises(checkpoint.CheckpointError, match="corrupt resume state"):
        checkpoint.load_trainer_state(folder / "state")
