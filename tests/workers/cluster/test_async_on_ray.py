"""Asynchronous rollouts (sampler.max_staleness=1) on the ray backend, the smoke experiment with its
roles colocated on CPU (each its own process): the fixed lag in every step's metrics, the rollout
generated ahead stored in the checkpoint, and a resume that equals the uninterrupted run; with partial
rollouts, a push that cuts the generation in flight and tokens no staler than the lag."""

from __future__ import annotations

import json

import pytest
import torch

from ppo_trainer.config import metric_names
from ppo_trainer.config.composition import compose
from ppo_trainer.config.derived import uses_reference
from ppo_trainer.run.trainer_state import ROLLOUTS_FILE
from ppo_trainer.trainer import run_training

# An environment in OpenRLHF's shape: feedback after the first answer, done after the second.
TWO_STEP_AGENT = """
from ppo_trainer.agents import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn >= 2
        return {"rewards": 0.5 * self.turn, "environment_feedback": "" if done else " again:", "done": done}
"""


def read_metrics(output_dir) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_lag_of_one_trains_on_the_fixed_schedule_and_resumes_exactly(ray_cluster, tmp_path):
    overrides = ["+experiment=smoke", "devices.backend=ray", "devices.accelerator=cpu", "devices.devices_per_node=4",
                 f"devices.ray.address={ray_cluster}", "sampler.max_staleness=1", "algorithm.rollout_correction=tis",
                 "trainer.total_steps=3", "trainer.save_every=1", "trainer.val_every=0", "trainer.loggers=[jsonl]"]
    run_training(compose([*overrides, f"trainer.output_dir={tmp_path / 'once'}"]))
    resumed = tmp_path / "resumed"
    run_training(compose([*overrides, f"trainer.output_dir={resumed}", "trainer.stop_after_steps=2"]))
    saved = torch.load(resumed / "checkpoints" / "global_step_2" / "state" / ROLLOUTS_FILE, weights_only=True)
    assert [s["step"] for s in saved] == [3]  # generated during step 2, with step 1's weights
    assert saved[0]["batch"]["policy_version"].unique().tolist() == [1]
    run_training(compose([*overrides, f"trainer.output_dir={resumed}"]))

    expected, got = read_metrics(tmp_path / "once"), read_metrics(resumed)
    assert sorted(got) == [0, 1, 2, 3]
    assert [expected[s]["rollout/staleness/max"] for s in (1, 2, 3)] == [0, 1, 1]
    assert expected[2]["rollout/staleness/mean"] == 1
    assert expected[3]["rollout_corr/weight_mean"] > 0 and expected[3]["actor/pg_clipfrac"] >= 0
    assert all(0 <= expected[s][f"perf/{role}/idle_share"] <= 1 for s in (1, 2, 3) for role in ("actor", "rollout"))
    keys = {k for k in expected[3] if not k.startswith(("timing_s/", "perf/"))}
    assert {k: got[3][k] for k in keys} == {k: expected[3][k] for k in keys}


def test_whole_multi_turn_episodes_are_generated_ahead(ray_cluster, tmp_path):
    """An environment's episodes lag like single turns: the rollout workers run them whole, ahead."""
    agent = tmp_path / "agent_func.py"
    agent.write_text(TWO_STEP_AGENT)
    out = tmp_path / "run"
    run_training(compose(["+experiment=smoke", "devices.backend=ray", "devices.accelerator=cpu",
                          "devices.devices_per_node=4", f"devices.ray.address={ray_cluster}",
                          "sampler.max_staleness=1", "algorithm.rollout_correction=tis",
                          f"sampler.multi_turn.env={agent}:AgentInstance", "sampler.multi_turn.max_turns=2",
                          "trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0",
                          "trainer.loggers=[jsonl]", f"trainer.output_dir={out}"]))
    metrics = read_metrics(out)
    assert [metrics[s]["rollout/staleness/max"] for s in (1, 2)] == [0, 1]
    assert all(metrics[s]["num_turns/mean"] == 2 for s in (1, 2))  # the agent ends each episode at its 2nd step


@pytest.mark.slow  # ~70 s on 2 cores: AsyncLLM starts its engine processes inside the Ray worker
def test_partial_rollouts_cut_the_generation_in_flight_and_no_token_is_staler_than_the_lag(ray_cluster, tmp_path):
    """vLLM's AsyncLLM in a threaded rollout worker. Responses of 512 tokens (ignore_eos) take several times
    as long as a step's training (one epoch in large micro-batches), so step 2's push lands while step 3's
    generation (submitted at step 2's start) runs: its samples continue under step 2's weights, and the
    checkpoint of step 2 holds them so."""
    out = tmp_path / "run"
    cfg = compose(["+experiment=smoke", "sampler=vllm", "sampler.vllm.kv_cache_gb=0.05", "sampler.max_new_tokens=512",
                   "sampler.ignore_eos=true", "eval.max_new_tokens=4", "algorithm.ppo_epochs=1",
                   "algorithm.ppo_micro_batch_tokens=8192", "devices.backend=ray", "devices.accelerator=cpu",
                   "devices.devices_per_node=4", f"devices.ray.address={ray_cluster}", "sampler.max_staleness=1",
                   "sampler.partial_rollouts=true", "algorithm.rollout_correction=tis", "trainer.total_steps=3",
                   "trainer.save_every=2", "trainer.val_every=0", "trainer.loggers=[jsonl]", f"trainer.output_dir={out}"])
    run_training(cfg)
    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1, 2, 3]
    logged = {k for m in metrics.values() for k in m if not any(p.fullmatch(k) for p in metric_names.PATTERNS)}
    assert logged - {"step"} == metric_names.produced(cfg, uses_reference(cfg))  # the catalogue (config/metric_names)
    assert [metrics[s]["rollout/staleness/max"] for s in (1, 2, 3)] == [0, 1, 1]  # step 3: the tokens before the cut
    assert metrics[3]["rollout/staleness/cut_share"] == 1.0 and metrics[3]["rollout/staleness/mean"] < 1
    assert metrics[3]["rollout_corr/weight_mean"] > 0 and metrics[3]["actor/pg_clipfrac"] >= 0
    (saved,) = torch.load(out / "checkpoints" / "global_step_2" / "state" / ROLLOUTS_FILE, weights_only=True)
    batch = saved["batch"]
    assert saved["step"] == 3 and batch["policy_version"].unique().tolist() == [1]
    assert batch["token_version"][batch["response_mask"].bool()].unique().tolist() == [1, 2]
