"""The trainer's weight sync as it runs: the actor's rank 0 streams buckets straight into every
rollout replica. After a step (an update, then the sync) the replicas' greedy tokens are the
actor's own greedy tokens (full and LoRA, vLLM locally and on Ray), whatever the bucket size."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.config.composition import compose
from ppo_trainer.engine.actor import ActorEngine
from ppo_trainer.evaluate import prompt_batch
from ppo_trainer.models.loading import resolve_model_path
from ppo_trainer.rollout import Sampler
from ppo_trainer.run.folder import absolute_output_dir, exclusive
from ppo_trainer.trainer import Trainer

BASE = ["+experiment=smoke", "sampler=vllm", "sampler.vllm.kv_cache_gb=0.05", "trainer.loggers=[jsonl]",
        "model.optim.lr=1e-2", "sampler.sync_bucket_mb=0.02",  # ~20 kB buckets: many per sync
        "reward.fn=streaming_digit_share:reward"]  # a reward that varies, so the update moves the weights


@pytest.fixture(autouse=True)
def digit_share_reward(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "streaming_digit_share.py").write_text(
        "def reward(response, ground_truth):\n    return sum(c.isdigit() for c in response) / max(len(response), 1)\n")


def actor_greedy(state: dict[str, torch.Tensor], prompts, max_new_tokens: int) -> list[list[int]]:
    """Greedy responses of a plain transformers model holding the actor's gathered weights (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("random:tiny"), dtype=torch.float32).eval()
    model.load_state_dict(state)
    out = []
    for row in range(len(prompts)):
        ids = prompts.input_ids[row][prompts.attention_mask[row].bool()][None]
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=model.generation_config.eos_token_id,
                                       pad_token_id=model.generation_config.pad_token_id)
        out.append(generated[0, ids.shape[1] :].tolist())
    return out


def check_greedy_after_a_step(overrides: list[str], tmp_path) -> None:
    cfg = compose([*BASE, *overrides, f"trainer.output_dir={tmp_path / 'run'}"])
    with exclusive(absolute_output_dir(cfg)):
        trainer = Trainer.from_config(cfg)
        try:
            before = {k: v.clone() for k, v in trainer.actor.run_all(ActorEngine.full_state_dict)[0].items()}
            trainer.step = 1
            metrics, _ = trainer.train_step(1)
            assert metrics["actor/grad_norm"] > 0 and metrics["perf/sync_bytes"] > 0
            prompts = prompt_batch(trainer.val_records[:6], trainer.pad_id)
            got = trainer.rollout.run_split(Sampler.generate, prompts, 1, seed=0, greedy=True, max_new_tokens=8)
            state = trainer.actor.run_all(ActorEngine.full_state_dict)[0]
        finally:
            trainer.close()
    assert max((state[k] - before[k]).abs().max().item() for k in state) > 1e-3, "the update moved the weights"
    responses = [got.response_ids[i][got.response_mask[i].bool()].tolist() for i in range(len(got))]
    assert responses == actor_greedy(state, prompts, 8)
    assert responses != actor_greedy(before, prompts, 8), "the new weights change the greedy tokens"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_local_vllm_generates_the_actors_greedy_tokens_after_a_step(tmp_path, lora):
    check_greedy_after_a_step(["model.lora.rank=4", "model.lora.alpha=8"] if lora else [], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_ray_vllm_replicas_generate_the_actors_greedy_tokens_after_a_step(ray_cluster, tmp_path, lora):
    """Two actor ranks (FSDP over gloo) stream into two vLLM replicas through Ray's object store."""
    ray = ["devices.backend=ray", "devices.accelerator=cpu", "devices.colocate=false", "devices.devices_per_node=4",
           f"devices.ray.address={ray_cluster}", "devices.actor.num_devices=2", "devices.rollout.num_devices=2"]
    check_greedy_after_a_step([*ray, *(["model.lora.rank=4", "model.lora.alpha=8"] if lora else [])], tmp_path)
