"""Non-finite guard: a NaN loss skips the optimizer step, is counted, and repeated skips stop the
run with the last good checkpoint intact."""

from __future__ import annotations

import json

import pytest
import torch

from ppo_trainer.config.composition import compose
from ppo_trainer.engine.fsdp import summarize_steps
from ppo_trainer.errors import NonFiniteError
from ppo_trainer.trainer import run_training


def test_summary_counts_skipped_steps_and_averages_the_taken_ones():
    history = [{"grad_norm": 2.0, "lr": 1.0, "skipped_steps": 0.0},
               {"grad_norm": float("nan"), "lr": 1.0, "skipped_steps": 1.0},
               {"grad_norm": 4.0, "lr": 1.0, "skipped_steps": 0.0}]
    assert summarize_steps(history) == {"skipped_steps": 1.0, "grad_norm": 3.0, "lr": 1.0}


def test_nan_actor_loss_skips_updates_then_stops_with_the_checkpoint_intact(tmp_path, monkeypatch):
    import ppo_trainer.core.losses as losses_module

    real_policy_loss = losses_module.policy_loss
    poisoned = {"on": False}

    def policy_loss(*args, **kwargs):
        out = real_policy_loss(*args, **kwargs)
        return out._replace(loss=out.loss * float("nan")) if poisoned["on"] else out

    monkeypatch.setattr(losses_module, "policy_loss", policy_loss)
    overrides = ["+experiment=smoke", f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]",
                 "trainer.total_steps=6", "trainer.save_every=1", "trainer.max_skipped_steps=2"]
    run_training(compose([*overrides, "trainer.stop_after_steps=1"]))
    good = tmp_path / "checkpoints" / "global_step_1"
    weights_before = (good / "actor" / "model.safetensors").read_bytes()

    poisoned["on"] = True
    with pytest.raises(NonFiniteError, match="global_step_2"):
        run_training(compose(overrides))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 2 and metrics[-1]["actor/skipped_steps"] > 0
    # Step 2 skipped every actor update but was saved; step 3 stopped the run before saving.
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step_2"
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "checkpoints" / "global_step_2" / "actor" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in saved.values())
    assert (good / "actor" / "model.safetensors").read_bytes() == weights_before


def test_the_streak_of_skipped_updates_survives_a_resume(tmp_path, monkeypatch):
    """max_skipped_steps=2: step 1 skips (streak 1, saved), the resumed run's step 2 skips too and
    stops the run; a resume that forgot the streak would count step 2 as the first."""
    import ppo_trainer.core.losses as losses_module

    real_policy_loss = losses_module.policy_loss
    monkeypatch.setattr(losses_module, "policy_loss",
                        lambda *a, **k: (lambda out: out._replace(loss=out.loss * float("nan")))(real_policy_loss(*a, **k)))
    overrides = ["+experiment=smoke", f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]",
                 "trainer.total_steps=4", "trainer.save_every=1", "trainer.max_skipped_steps=2"]
    run_training(compose([*overrides, "trainer.stop_after_steps=1"]))
    with pytest.raises(NonFiniteError, match="2 PPO steps in a row.*global_step_1"):
        run_training(compose(overrides))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 1
