"""What the run folder decides before any model loads: a rerun of a finished run prints its summary
(or its last objective) instead of training (`trainer_state.finished_run`), a raised
trainer.total_steps continues it; a resume compares paths absolute (`resume.config_changes`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ppo_trainer.config.composition import compose
from ppo_trainer.run import checkpoint, resume, trainer_state


def finished_folder(out: Path, step: int, summary: str | None = None) -> Path:
    """A run folder whose latest checkpoint is `step` (the files a resume reads), its metrics.jsonl
    validating at steps 0 and `step`, and summary.txt when given."""
    folder = checkpoint.step_dir(out, step)
    for role in ("actor", "critic"):
        (folder / "state" / role).mkdir(parents=True)
    state = {key: {} for key in checkpoint.REQUIRED_STATE} | {"step": step, "best": None}
    (folder / "state" / "trainer.json").write_text(json.dumps(state))
    torch.save({"torch": torch.get_rng_state()}, folder / "state" / "rng.pt")
    checkpoint.write_pointer(out, "latest", step)
    records = [{"step": 0, "val/accuracy": 0.25}, {"step": 1, "critic/score/mean": 0.1},
               {"step": step, "val/accuracy": 0.5}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (out / "summary.txt").write_text(summary + "\n")
    return folder


def test_a_finished_run_prints_its_saved_summary_and_the_way_to_go_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    finished_folder(tmp_path / "run", 4, summary="run finished: 4 of 4 steps\n  objective:  ...")
    text, objective = trainer_state.finished_run(compose(["+experiment=smoke"]), tmp_path / "run")
    assert text == ("ppo-train: this run already finished: run/checkpoints/global_step_4 is step 4 of "
                    "trainer.total_steps=4; raise trainer.total_steps to continue it, or start over with "
                    "trainer.resume=never. Its summary (run/summary.txt):\nrun finished: 4 of 4 steps\n  objective:  ...")
    assert objective == 0.5


def test_without_a_summary_it_says_the_last_objective_from_metrics_jsonl(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    finished_folder(tmp_path / "run", 4)
    text, objective = trainer_state.finished_run(compose(["+experiment=smoke"]), tmp_path / "run")
    assert text.endswith("trainer.resume=never. Last val/accuracy: 0.5 (step 4)") and objective == 0.5


@pytest.mark.parametrize("overrides", [["trainer.total_steps=6"], ["trainer.resume=never"]])
def test_a_raised_total_or_a_fresh_start_trains(tmp_path, overrides):
    finished_folder(tmp_path / "run", 4)
    assert trainer_state.finished_run(compose(["+experiment=smoke", *overrides]), tmp_path / "run") is None


def test_a_resume_sees_no_change_between_a_relative_path_typed_and_the_absolute_one_saved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    typed = compose(["data.val_files=[data/v.jsonl]", "reward.fn=rewards.py:f"])
    saved = compose([f"data.val_files=[{tmp_path / 'data' / 'v.jsonl'}]", f"reward.fn={tmp_path / 'rewards.py'}:f"])
    assert resume.config_changes(saved, typed) == []
    older = OmegaConf.create(OmegaConf.to_container(typed))  # as an older version saved it: relative
    assert resume.config_changes(older, saved) == []
    moved = compose([f"data.val_files=[{tmp_path / 'elsewhere' / 'v.jsonl'}]", "reward.fn=rewards.py:f"])
    assert resume.config_changes(saved, moved) == [("data.val_files", [str(tmp_path / "data" / "v.jsonl")],
                                                    [str(tmp_path / "elsewhere" / "v.jsonl")])]
