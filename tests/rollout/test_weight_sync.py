"""After an actor update, a weight push (`load_weight_bucket`, `finish_weight_sync`) makes the sampler sample from the updated policy.

The proof is in the logprobs: the engine's sampling logprobs of its own tokens equal the actor's
recomputed log_softmax(logits / T) (fp32, < 1e-3) after the push, and visibly differ before it.
The prompts repeat across generations, so a stale prefix cache would also show up as a mismatch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ppo_trainer.batch import Batch
from ppo_trainer.rollout import HFSampler

from .conftest import load_model, reference_logprobs, sampler_config

MATCH = 1e-3  # fp32 engine vs fp32 actor
STALE = 1e-2  # the update moves logprobs by far more than this


def optimizer_step(model, batch: Batch, lr: float = 1e-2) -> None:
    """One Adam step raising the logprobs of the batch's responses (a stand-in for a PPO update)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    P, T = batch.prompt_length, batch.response_length
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits[:, P - 1 : P + T - 1]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    loss = -(logprobs * batch.response_mask).sum() / batch.response_mask.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def max_gap(sampler, actor, prompts: Batch, temperature: float) -> float:
    """Largest |sampling logprob - actor logprob| over the sampler's tokens at this temperature."""
    sampler.cfg = sampler_config(temperature=temperature)
    out = sampler.generate(prompts, 4, seed=7)
    actor.eval()
    expected = reference_logprobs(actor, out, temperature)
    return (expected - out.sample_logprobs).abs()[out.response_mask.bool()].max().item()


def check_sync(sampler, actor, prompts: Batch, merged_state) -> None:
    """The engine starts at the actor's pre-update weights; mismatch after the step, match after sync."""
    rollout = sampler.generate(prompts, 4, seed=1)
    optimizer_step(actor, rollout)
    for temperature in (1.0, 0.7):
        assert max_gap(sampler, actor, prompts, temperature) > STALE, "the engine already had the new weights"
    sampler.load_weight_bucket(merged_state())
    sampler.finish_weight_sync()
    for temperature in (1.0, 0.7):
        assert max_gap(sampler, actor, prompts, temperature) < MATCH


@pytest.mark.parametrize("as_bytes", [False, True], ids=["tensors", "safetensors-bytes"])
def test_vllm_matches_the_full_fine_tuned_actor_only_after_sync(vllm_sampler, tiny_model_dir, prompts, monkeypatch,
                                                                as_bytes):
    assert vllm_sampler._worker_in_process, "the test engine's worker runs in this process: tensors, not bytes"
    if as_bytes:  # the form a worker in another process (tensor parallel, V1 multiprocessing) receives
        monkeypatch.setattr(vllm_sampler, "_worker_in_process", False)
    actor = load_model(tiny_model_dir)
    vllm_sampler.load_weight_bucket(actor.state_dict())
    vllm_sampler.finish_weight_sync()
    check_sync(vllm_sampler, actor, prompts, merged_state=actor.state_dict)


def test_vllm_matches_the_lora_actor_after_syncing_merged_weights(vllm_sampler, tiny_model_dir, prompts):
    from peft import LoraConfig, get_peft_model

    base = load_model(tiny_model_dir)
    vllm_sampler.load_weight_bucket(base.state_dict())
    vllm_sampler.finish_weight_sync()
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    actor = get_peft_model(base, lora)

    def merged_state() -> dict[str, torch.Tensor]:
        merged = copy.deepcopy(actor).merge_and_unload().state_dict()
        assert not any("lora" in name for name in merged)
        return merged

    check_sync(vllm_sampler, actor, prompts, merged_state)


def test_hf_sampler_with_its_own_copy_matches_the_actor_only_after_sync(tiny_model_dir, prompts):
    actor = load_model(tiny_model_dir)
    sampler = HFSampler(tiny_model_dir, sampler_config(), batch_size=8)
    assert sampler.model is not actor and not sampler.model.training, "its own copy, in eval mode (no dropout)"
    check_sync(sampler, actor, prompts, merged_state=actor.state_dict)


def test_hf_sync_rejects_names_the_model_does_not_have(tiny_model_dir):
    sampler = HFSampler(tiny_model_dir, sampler_config())
    with pytest.raises(KeyError, match="unknown"):
        sampler.load_weight_bucket({"model.not_a_layer.weight": torch.zeros(1)})
        sampler.finish_weight_sync()
