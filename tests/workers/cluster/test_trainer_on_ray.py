"""The smoke experiment end to end on the ray backend: 2 actor replicas (FSDP2 over gloo), 1
critic, 1 vLLM CPU rollout, on the session's Ray cluster (CPU slots); then a resume."""

from __future__ import annotations

import json

import pytest

from ppo_trainer.config.composition import compose
from ppo_trainer.trainer import run_training


def read_metrics(output_dir) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())}


def test_smoke_runs_and_resumes_on_ray_with_two_actor_ranks_and_vllm(ray_cluster, tmp_path):
    overrides = ["+experiment=smoke", "sampler=vllm", "devices.backend=ray", "devices.accelerator=cpu",
                 "devices.colocate=false", "devices.devices_per_node=4", f"devices.ray.address={ray_cluster}",
                 "devices.actor.num_devices=2", "devices.critic.num_devices=1", "devices.rollout.num_devices=1",
                 "trainer.total_steps=3", "trainer.save_every=1", f"trainer.output_dir={tmp_path}",
                 "trainer.loggers=[jsonl]"]
    run_training(compose([*overrides, "trainer.stop_after_steps=2"]))
    run_training(compose(overrides))  # resumes from step 2
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    for m in metrics[1:]:
        assert m["rollout/logprob_diff_max"] < 1e-2, "the vLLM engine samples from the actor's weights"
        assert "actor/pg_loss" in m and "critic/vf_loss" in m
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step_3"


@pytest.mark.slow
def test_resume_on_ray_with_lora_dropout_continues_exactly_as_an_uninterrupted_run(ray_cluster, tmp_path, monkeypatch):
    """Every worker's RNG (here: the LoRA dropout masks of 2 actor ranks) is part of the resume
    state. A reward that varies between samples (the share of digits) makes the updates move."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "digit_share_reward.py").write_text(
        "def reward(response, ground_truth):\n    return sum(c.isdigit() for c in response) / max(len(response), 1)\n")
    overrides = ["+experiment=smoke", "devices.backend=ray", "devices.accelerator=cpu", "devices.colocate=false",
                 "devices.devices_per_node=4", f"devices.ray.address={ray_cluster}", "devices.actor.num_devices=2",
                 "model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.5", "model.optim.lr=1e-2",
                 "reward.fn=digit_share_reward:reward", "trainer.total_steps=3", "trainer.save_every=1",
                 "trainer.val_every=0", "trainer.loggers=[jsonl]"]
    run_training(compose([*overrides, f"trainer.output_dir={tmp_path / 'once'}"]))
    resumed = tmp_path / "resumed"
    run_training(compose([*overrides, f"trainer.output_dir={resumed}", "trainer.stop_after_steps=2"]))
    run_training(compose([*overrides, f"trainer.output_dir={resumed}"]))
    expected, got = read_metrics(tmp_path / "once"), read_metrics(resumed)
    assert sorted(got) == [0, 1, 2, 3]
    assert expected[3]["actor/grad_norm"] > 0 and expected[3]["actor/pg_clipfrac"] > 0  # the policy moves
    keys = {k for k in expected[3] if not k.startswith(("timing_s/", "perf/"))}
    assert {k: got[3][k] for k in keys} == {k: expected[3][k] for k in keys}


def test_a_cluster_too_small_for_the_request_exits_2_with_one_line(ray_cluster, tmp_path, capsys, monkeypatch):
    """The session cluster has 4 (fake) GPUs on 2 nodes; 8 rollout GPUs cannot be placed."""
    from ppo_trainer.cli import train_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        train_main(["+experiment=smoke", "devices.backend=ray", "devices.accelerator=cuda", "devices.devices_per_node=8",
                    f"devices.ray.address={ray_cluster}", "devices.rollout.num_devices=8",
                    f"trainer.output_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ppo-train")]
    assert len(err) == 1 and err[0].startswith("ppo-train: input error: devices.colocate=true (a shared pool of max(devices.*.num_devices)=8) GPUs do not fit")


def test_a_reward_model_on_ray_scores_as_a_plain_transformers_forward(ray_cluster, tmp_path):
    """The reward model role on its own Ray pool; its replica's scores of a few conversations equal
    one unpadded transformers forward each (float32)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from ppo_trainer.models.loading import resolve_model_path
    from ppo_trainer.rewards.calling import RewardInput
    from ppo_trainer.run.folder import absolute_output_dir, exclusive
    from ppo_trainer.trainer import Trainer

    cfg = compose(["+experiment=smoke", "devices.backend=ray", "devices.accelerator=cpu", "devices.colocate=false",
                   "devices.devices_per_node=4", f"devices.ray.address={ray_cluster}", "reward.fn=null",
                   "reward.model.path=random:tiny-reward", "reward.model.dtype=float32", "trainer.loggers=[jsonl]",
                   f"trainer.output_dir={tmp_path}"])
    conversations = [([{"role": "user", "content": q}], r) for q, r in (("3+4?", "7"), ("2+2?", "4"), ("7 again", "77x"))]
    rows = [RewardInput(r, None, "s", None, m[0]["content"], m) for m, r in conversations]
    with exclusive(absolute_output_dir(cfg)):
        trainer = Trainer.from_config(cfg)
        try:
            assert len(trainer.groups["reward_model"]) == 1
            got = trainer.scorer.parts[0].scorer.score(rows).values
        finally:
            trainer.close()
    folder = resolve_model_path("random:tiny-reward")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    expected = []
    for messages, response in conversations:
        text = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
        with torch.no_grad():
            expected.append(model(**tokenizer(text, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item())
    assert got == pytest.approx(expected, abs=1e-5) and got == pytest.approx([1.0, 0.0, 0.0], abs=1e-5)
