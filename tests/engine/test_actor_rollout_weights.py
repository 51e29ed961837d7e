"""The actor's update uses the batch's rollout correction weights (one process, 1-rank FSDP2)."""

from __future__ import annotations

import pytest
import torch
from engine_cases import PROMPT_LENS, RESPONSE_LENS, SMALL_BUDGET, full_grads, make_actor, random_batch


def gradients(actor, batch):
    actor.backward_mini_batch(batch, actor.micro_batch_loss, SMALL_BUDGET)
    grads = full_grads(actor.module)
    actor.optimizer.zero_grad(set_to_none=True)
    return grads


def test_rollout_weights_scale_the_policy_gradient_over_micro_batches(tiny_model_dir):
    actor = make_actor(tiny_model_dir, algorithm={"rollout_correction": "tis"})
    batch = random_batch(PROMPT_LENS, RESPONSE_LENS)
    batch = batch.with_fields(old_logprobs=actor.compute_logprobs(batch))
    plain = gradients(actor, batch)
    doubled = gradients(actor, batch.with_fields(rollout_weights=2.0 * batch.response_mask.float()))
    assert plain.keys() == doubled.keys() and any(g.abs().max() > 0 for g in plain.values())
    for name, g in plain.items():
        torch.testing.assert_close(doubled[name], 2 * g, atol=1e-7, rtol=1e-5)
    dropped = gradients(actor, batch.with_fields(rollout_weights=torch.zeros_like(batch.response_mask).float()))
    assert all(g.abs().max() == 0 for g in dropped.values())


def test_update_refuses_a_batch_without_the_weights_it_was_configured_for(tiny_model_dir):
    actor = make_actor(tiny_model_dir, algorithm={"rollout_correction": "mis"})
    batch = random_batch(PROMPT_LENS, RESPONSE_LENS)
    with pytest.raises(ValueError, match="rollout_weights"):
        actor.update(batch)
