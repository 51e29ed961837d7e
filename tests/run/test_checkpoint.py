"""Atomic checkpoints: a half-written step is never resumed from; rotation keeps the newest saves
(commit order) and the best; every sequence of saves leaves `latest` naming a complete step."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ppo_trainer.run import checkpoint

PARTS = {"actor": 1, "critic": 1}


def stage(output_dir: Path, step: int, roles: tuple[str, ...] = ("actor", "critic")) -> Path:
    """A staged step as the trainer writes it: each role's folders and manifest, the driver's state."""
    staging = checkpoint.begin(output_dir, step)
    for role in roles:
        (staging / role).mkdir()
        (staging / role / "model.safetensors").write_bytes(b"w" * step)
        (staging / "state" / role).mkdir(parents=True)
        checkpoint.write_manifest(staging, role, 0, [role, f"state/{role}"])
    state = {key: {} for key in checkpoint.REQUIRED_STATE} | {"step": step, "best": None}
    checkpoint.save_trainer_state(staging / "state", state, {"torch": torch.get_rng_state()},
                                  OmegaConf.create({"step": step}))
    return staging


def write_step(output_dir: Path, step: int, keep_last: int = 2, best: bool = False) -> Path:
    stage(output_dir, step)
    return checkpoint.commit(output_dir, step, keep_last, PARTS, best=best)


def pointer(output_dir: Path, name: str) -> str:
    return (output_dir / "checkpoints" / name).read_text().strip()


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
    assert not crashed.exists(), "a resume clears leftovers of any step"


def test_leftovers_of_any_step_are_removed_when_a_save_begins(tmp_path):
    """A save that died on a full disk must not keep its space: the next save, of whatever step, frees it."""
    write_step(tmp_path, 2)
    for leftover in (checkpoint.staging_dir(tmp_path, 7), tmp_path / "checkpoints" / ".removing_global_step_1"):
        leftover.mkdir()
        (leftover / "big.bin").write_bytes(b"\0" * 1000)
    checkpoint.begin(tmp_path, 3)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [".incomplete_global_step_3", "commit_order", "global_step_2", "latest"]


def test_rotation_keeps_the_newest_keep_last(tmp_path):
    for step in range(1, 6):
        write_step(tmp_path, step, keep_last=2)
    assert checkpoint.complete_steps(tmp_path) == [4, 5]
    assert pointer(tmp_path, "latest") == "global_step_5"


def test_rotation_keeps_the_step_best_names(tmp_path):
    for step in range(1, 6):
        write_step(tmp_path, step, keep_last=1, best=step == 2)
    assert checkpoint.complete_steps(tmp_path) == [2, 5]
    assert checkpoint.read_pointer(tmp_path / "checkpoints" / "best") == tmp_path / "checkpoints" / "global_step_2"
    write_step(tmp_path, 6, keep_last=1, best=True)  # a new best: the old one may go
    assert checkpoint.complete_steps(tmp_path) == [6]


def test_rotation_follows_commit_order_not_step_numbers(tmp_path):
    """Resumed from global_step_2 of a run that reached 6: the new step 3 is the newest save and stays
    (ranking by step number deleted it right after its commit, leaving `latest` naming nothing)."""
    for step in (2, 4, 6):
        write_step(tmp_path, step, keep_last=2)
    assert checkpoint.complete_steps(tmp_path) == [4, 6]
    write_step(tmp_path, 3, keep_last=2)
    assert checkpoint.complete_steps(tmp_path) == [3, 6]
    assert checkpoint.resolve_resume(tmp_path, "auto").name == "global_step_3"
    write_step(tmp_path, 4, keep_last=2)  # step 6 is now the oldest save
    assert checkpoint.complete_steps(tmp_path) == [3, 4]
    assert (tmp_path / "checkpoints" / "commit_order").read_text().split() == ["global_step_3", "global_step_4"]


def test_unrecorded_step_folders_count_as_older_than_recorded_saves(tmp_path):
    """Checkpoints of a version without commit_order rotate out before anything this version saved."""
    for step in (5, 6):
        write_step(tmp_path, step, keep_last=5)
    (tmp_path / "checkpoints" / "commit_order").unlink()
    write_step(tmp_path, 1, keep_last=2)
    assert checkpoint.commit_order(tmp_path) == [6, 1]


def test_saving_a_step_again_moves_the_old_copy_aside_first(tmp_path, monkeypatch):
    """A crash between moving the old step 4 aside and renaming the new one in: `latest` (step 4)
    names a folder again once `recover` runs, and it is the old, complete copy."""
    write_step(tmp_path, 4)
    stage(tmp_path, 4)
    real_replace = os.replace

    def crash_on_the_rename_in(src, dst):
        if Path(src).name.startswith(".incomplete_"):
            raise OSError("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_the_rename_in)
    with pytest.raises(OSError, match="killed"):
        checkpoint.commit(tmp_path, 4, 2, PARTS)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (tmp_path / "checkpoints" / "global_step_4").exists()
    assert checkpoint.resolve_resume(tmp_path, "auto").name == "global_step_4"  # recovered
    assert not list((tmp_path / "checkpoints").glob(".*global_step_*"))

    stage(tmp_path, 4)
    (checkpoint.staging_dir(tmp_path, 4) / "new.txt").write_text("new")
    folder = checkpoint.commit(tmp_path, 4, 2, PARTS)
    assert (folder / "new.txt").is_file() and not list((tmp_path / "checkpoints").glob(".replaced_*"))


def test_a_best_pointer_whose_folder_is_gone_is_dropped_with_one_warning(tmp_path, caplog):
    write_step(tmp_path, 1, keep_last=5, best=True)
    write_step(tmp_path, 2, keep_last=5)
    shutil.rmtree(tmp_path / "checkpoints" / "global_step_1")  # a user freed disk
    with caplog.at_level(logging.WARNING, logger="ppo_trainer"):
        write_step(tmp_path, 3, keep_last=5)
        write_step(tmp_path, 4, keep_last=5)
    warnings = [r.getMessage() for r in caplog.records if "best" in r.getMessage()]
    assert len(warnings) == 1 and "global_step_1" in warnings[0]
    assert not (tmp_path / "checkpoints" / "best").exists()
    assert pointer(tmp_path, "latest") == "global_step_4"


def test_a_dangling_latest_names_the_checkpoints_that_exist(tmp_path):
    write_step(tmp_path, 1, keep_last=5)
    write_step(tmp_path, 2, keep_last=5)
    shutil.rmtree(tmp_path / "checkpoints" / "global_step_2")
    with pytest.raises(checkpoint.CheckpointError, match="global_step_1.*trainer.resume=never"):
        checkpoint.resolve_resume(tmp_path, "auto")


def test_a_missing_role_part_fails_the_save_naming_the_role_and_path(tmp_path):
    write_step(tmp_path, 1)
    stage(tmp_path, 2, roles=("actor",))  # the critic's worker wrote elsewhere (an unshared folder)
    with pytest.raises(checkpoint.CheckpointSaveError, match=r"critic worker \(rank 0\).*manifest/critic\.0\.json"):
        checkpoint.commit(tmp_path, 2, 2, PARTS)
    assert pointer(tmp_path, "latest") == "global_step_1" and checkpoint.complete_steps(tmp_path) == [1]


def test_a_file_missing_from_a_manifest_fails_the_save(tmp_path):
    staging = stage(tmp_path, 1)
    (staging / "actor" / "model.safetensors").unlink()
    with pytest.raises(checkpoint.CheckpointSaveError, match=r"actor worker \(rank 0\) wrote .*model.safetensors"):
        checkpoint.commit(tmp_path, 1, 2, PARTS)
    with pytest.raises(checkpoint.CheckpointSaveError, match=r"rank 1"):
        checkpoint.verify(stage(tmp_path, 1), {"actor": 2})


def test_resume_never_and_explicit_path(tmp_path, monkeypatch):
    folder = write_step(tmp_path, 1)
    assert checkpoint.resolve_resume(tmp_path, "never") is None
    assert checkpoint.resolve_resume(tmp_path, str(folder)) == folder
    monkeypatch.chdir(tmp_path)
    assert checkpoint.resolve_resume(tmp_path, "checkpoints/global_step_1") == folder, "a relative path is made absolute"


def test_each_checkpoint_stores_the_config_it_was_trained_with(tmp_path):
    folder = write_step(tmp_path, 3)
    assert checkpoint.saved_config(folder).step == 3


def test_rng_state_loads_with_weights_only(tmp_path):
    folder = write_step(tmp_path, 1)
    state, rng = checkpoint.load_trainer_state(folder / "state")
    assert state["step"] == 1 and torch.equal(rng["torch"], torch.get_rng_state())


def test_truncated_trainer_state_is_reported_as_corrupt(tmp_path):
    folder = write_step(tmp_path, 1)
    (folder / "state" / "rng.pt").write_bytes(b"garbage")
    with pytest.raises(checkpoint.CheckpointError, match="corrupt resume state"):
        checkpoint.load_trainer_state(folder / "state")
