"""Summed micro-batch gradients equal the full-batch gradient when the global counts are passed."""

import pytest
import torch

from ppo_trainer.core.choices import AGG_MODES
from ppo_trainer.core.losses import policy_loss, value_loss

BATCH, LENGTH, FEATURES = 12, 9, 4


def ragged_rollout(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, LENGTH + 1, (BATCH,), generator=gen)
    lengths[0] = LENGTH
    return {
        "mask": (torch.arange(LENGTH) < lengths[:, None]).long(),
        "features": torch.randn(BATCH, LENGTH, FEATURES, generator=gen, dtype=torch.float64),
        "old": torch.randn(BATCH, LENGTH, generator=gen, dtype=torch.float64),
        "advantages": torch.randn(BATCH, LENGTH, generator=gen, dtype=torch.float64),
        "returns": torch.randn(BATCH, LENGTH, generator=gen, dtype=torch.float64),
    }


def random_split(seed):
    """Shuffle the rows and cut them into 1..5 micro-batches of uneven size."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(BATCH, generator=gen)
    pieces = int(torch.randint(1, 6, (1,), generator=gen))
    cuts = sorted(torch.randperm(BATCH - 1, generator=gen)[: pieces - 1].add(1).tolist())
    return [chunk for chunk in torch.tensor_split(order, cuts) if len(chunk)]


def policy_objective(weight, rows, data, mode, dual_clip, global_tokens, global_seqs):
    # A shared parameter makes every row's loss pull on the same gradient, as in a real model;
    # the scale puts ratios on both sides of the clip range.
    logprobs = data["old"][rows] + 0.5 * torch.tanh(data["features"][rows] @ weight)
    return policy_loss(
        logprobs, data["old"][rows], data["advantages"][rows], data["mask"][rows], 0.2, 0.28,
        dual_clip=dual_clip, agg=mode, global_tokens=global_tokens, global_seqs=global_seqs,
    ).loss


def value_objective(weight, rows, data, mode, clip, global_tokens, global_seqs):
    values = data["old"][rows] + data["features"][rows] @ weight
    return value_loss(
        values, data["old"][rows], data["returns"][rows], data["mask"][rows], clip=clip,
        agg=mode, global_tokens=global_tokens, global_seqs=global_seqs,
    ).loss


def full_and_accumulated(objective, option, mode, seed):
    data = ragged_rollout(seed)
    weight = torch.randn(FEATURES, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    weight.requires_grad_(True)

    full = objective(weight, torch.arange(BATCH), data, mode, option, None, None)
    (full_grad,) = torch.autograd.grad(full, weight)

    global_tokens, global_seqs = data["mask"].sum(), BATCH
    summed_loss = 0.0
    for rows in random_split(seed + 2):
        loss = objective(weight, rows, data, mode, option, global_tokens, global_seqs)
        loss.backward()
        summed_loss += loss.item()
    return full.item(), full_grad, summed_loss, weight.grad


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_gradient_accumulation_matches_full_batch(mode, dual_clip, seed):
    full, full_grad, summed, summed_grad = full_and_accumulated(policy_objective, dual_clip, mode, seed)
    assert summed == pytest.approx(full, abs=1e-9)
    torch.testing.assert_close(summed_grad, full_grad, atol=1e-6, rtol=0)
    assert full_grad.abs().sum() > 0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip", [None, 0.3])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_gradient_accumulation_matches_full_batch(mode, clip, seed):
    full, full_grad, summed, summed_grad = full_and_accumulated(value_objective, clip, mode, seed)
    assert summed == pytest.approx(full, abs=1e-9)
    torch.testing.assert_close(summed_grad, full_grad, atol=1e-6, rtol=0)
    assert full_grad.abs().sum() > 0


def test_per_micro_batch_token_mean_would_not_match():
    # Guards the test itself: local normalisation (the classic bug) gives a different gradient.
    data = ragged_rollout(0)
    weight = torch.ones(FEATURES, dtype=torch.float64, requires_grad=True)
    full = policy_objective(weight, torch.arange(BATCH), data, "token-mean", None, None, None)
    (full_grad,) = torch.autograd.grad(full, weight)
    splits = [torch.arange(0, 3), torch.arange(3, BATCH)]
    for rows in splits:
        (policy_objective(weight, rows, data, "token-mean", None, None, None) / len(splits)).backward()
    assert not torch.allclose(weight.grad, full_grad, atol=1e-6)
