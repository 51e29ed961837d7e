"""sampler.max_staleness and sampler.partial_rollouts (asynchronous rollouts, docs/async.md): lock-step
by default; what a lagged policy cannot do is refused (exit 2, one line naming both keys, before any
model loads), each rule apart; partial rollouts need vLLM, a lag and no environment; a changed lag or
partial setting is refused on resume."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ppo_trainer.config.composition import compose
from ppo_trainer.config.schema import ConfigError
from ppo_trainer.plan.dry_run import algorithm_lines
from ppo_trainer.run.resume import REFUSED, check_config

RAY = ("devices.backend=ray", "algorithm.rollout_correction=tis")


def message(line: str) -> str:
    """The config error's own words, after the `ppo-train: config error: ` prefix."""
    return line.partition(": config error: ")[2]


def test_lock_step_is_the_default():
    s = compose([]).sampler
    assert (s.max_staleness, s.partial_rollouts) == (0, False)


@pytest.mark.usefixtures("no_model_loading")
def test_a_negative_staleness_exits_2_saying_0_is_lock_step(ppo_train_error):
    line = ppo_train_error("sampler.max_staleness=-1")
    assert "'sampler.max_staleness' must be >= 0 (0 is lock-step), got -1" in line


@pytest.mark.usefixtures("no_model_loading")
def test_staleness_without_recomputed_old_logprobs_exits_2_naming_both_keys(ppo_train_error):
    line = ppo_train_error("devices.backend=ray", "sampler.max_staleness=1", "algorithm.recompute_old_logprobs=false")
    assert message(line).startswith("'sampler.max_staleness' is 1 with algorithm.recompute_old_logprobs=false")
    assert "set algorithm.recompute_old_logprobs=true, or sampler.max_staleness=0" in line


@pytest.mark.usefixtures("no_model_loading")
def test_staleness_without_a_rollout_correction_exits_2_naming_both_keys(ppo_train_error):
    line = ppo_train_error("devices.backend=ray", "sampler.max_staleness=1")
    assert message(line).startswith("'sampler.max_staleness' is 1 with algorithm.rollout_correction=none")
    assert "set algorithm.rollout_correction=tis (or mis), or sampler.max_staleness=0" in line


@pytest.mark.usefixtures("no_model_loading")
def test_staleness_on_the_local_backend_exits_2_naming_both_keys(ppo_train_error):
    line = ppo_train_error("algorithm.rollout_correction=tis", "sampler.max_staleness=2")
    assert message(line).startswith("'sampler.max_staleness' is 2 with devices.backend=local: one process cannot")
    assert "set devices.backend=ray, or sampler.max_staleness=0" in line


@pytest.mark.usefixtures("no_model_loading")
@pytest.mark.parametrize("accelerator", ["cuda", "npu", "auto"])
def test_staleness_with_colocated_accelerators_exits_2_naming_both_keys(ppo_train_error, accelerator):
    line = ppo_train_error(*RAY, "devices.colocate=true", f"devices.accelerator={accelerator}",
                           "sampler.max_staleness=1")
    assert message(line).startswith(f"'sampler.max_staleness' is 1 with devices.colocate=true on "
                                    f"devices.accelerator={accelerator}: on GPUs and NPUs vLLM sleeps")
    assert "set devices.colocate=false (or devices.accelerator=cpu), or sampler.max_staleness=0" in line


@pytest.mark.parametrize("placement", [
    ["devices.colocate=true"],  # on CPU nothing sleeps: colocated roles still overlap
    ["devices.colocate=false", "devices.accelerator=cuda"],
    ["sampler.multi_turn.env=ppo_trainer.agents.tasks:RevealDigit"],  # whole episodes lag like single turns
])
def test_a_staleness_the_rules_allow_composes(placement):
    assert compose([*RAY, *placement, "sampler.max_staleness=1"]).sampler.max_staleness == 1


@pytest.mark.usefixtures("no_model_loading")
@pytest.mark.parametrize("overrides, expected", [
    (["sampler=hf", "sampler.max_staleness=1"], "is true with sampler=hf: only vLLM"),
    (["sampler=vllm"], "is true with sampler.max_staleness=0: lock-step rollouts"),
    (["sampler=vllm", "sampler.max_staleness=1", "sampler.multi_turn.env=ppo_trainer.agents.tasks:RevealDigit"],
     "is true with sampler.multi_turn.env: an environment's episode"),
])
def test_partial_rollouts_exit_2_naming_the_key_they_need(ppo_train_error, overrides, expected):
    line = ppo_train_error(*RAY, "sampler.partial_rollouts=true", *overrides)
    assert message(line).startswith(f"'sampler.partial_rollouts' {expected}")


@pytest.mark.parametrize("turns", [[], ["sampler.multi_turn.tools=[calculator]"]])
def test_partial_rollouts_compose_with_vllm_a_lag_and_single_turns_or_tools(turns):
    cfg = compose([*RAY, "sampler=vllm", "sampler.max_staleness=1", "sampler.partial_rollouts=true", *turns])
    assert cfg.sampler.partial_rollouts and cfg.sampler.max_staleness == 1


def test_the_dry_run_plan_says_whether_a_push_cuts_the_generation_in_flight():
    whole = [*RAY, "sampler=vllm", "sampler.max_staleness=1"]
    rollouts = [next(line for line in algorithm_lines(compose(overrides)) if line.startswith("rollouts:"))
                for overrides in (whole, [*whole, "sampler.partial_rollouts=true"])]
    assert rollouts == ["rollouts:  generated 1 step ahead while the trainers train: step s trains on samples from "
                        "the weights after step max(0, s-2) (docs/async.md)",
                        "rollouts:  generated 1 step ahead while the trainers train: step s trains on samples from "
                        "the weights after step max(0, s-2); a weight push cuts the generation in flight, which "
                        "continues on the new weights (sampler.partial_rollouts) (docs/async.md)"]


@pytest.mark.parametrize("key, saved_value", [("sampler.max_staleness", 1), ("sampler.partial_rollouts", True)])
def test_a_changed_lag_or_partial_setting_is_refused_on_resume(key, saved_value):
    """The rollouts in flight at a checkpoint were generated for its lag and its pushes (cut or whole):
    another setting continues another run."""
    assert key in REFUSED
    cfg = compose(["+experiment=smoke"])
    saved = OmegaConf.create(OmegaConf.to_container(cfg))
    OmegaConf.update(saved, key, saved_value)
    changed = f"{key} {str(saved_value).lower() if isinstance(saved_value, bool) else saved_value} -> "
    with pytest.raises(ConfigError, match=rf"refused: {re.escape(changed)}.*resume_allow=\[{re.escape(key)}"):
        check_config(Path("checkpoints/global_step_2"), saved, {"step": 2}, cfg)
