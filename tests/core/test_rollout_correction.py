"""Rollout correction weights (tis, mis), their diagnostics, and how they enter the policy loss."""

import math

import pytest
import torch

from ppo_trainer.core.losses import policy_loss
from ppo_trainer.core.rollout_correction import rollout_weights


def reference_weights(old, sample, mask, mode, cap, low, high):
    """One sequence and one token at a time, in float64 python numbers."""
    B, T = mask.shape
    weights = torch.zeros(B, T, dtype=torch.float64)
    truncated = masked = rows = tokens = 0
    kl = 0.0
    for b in range(B):
        steps = [t for t in range(T) if mask[b, t]]
        ratios = [math.exp(float(old[b, t]) - float(sample[b, t])) for t in steps]
        for r in ratios:
            kl += r - 1 - math.log(r)  # k3 of KL(rollout || old): samples are the rollout's
        tokens += len(steps)
        if not steps:
            continue
        rows += 1
        if mode == "tis":
            for t, r in zip(steps, ratios):
                weights[b, t] = min(r, cap)
                truncated += r > cap
        else:
            geometric_mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            keep = low <= geometric_mean <= high
            masked += not keep
            for t in steps:
                weights[b, t] = 1.0 if keep else 0.0
    valid = weights[mask.bool()].tolist()
    total, squares = sum(valid), sum(w * w for w in valid)
    stats = {
        "kl_k3": kl / tokens,
        "weight_mean": total / tokens,
        "weight_max": max(valid),
        "ess": total**2 / (tokens * squares) if squares else 0.0,
    }
    if mode == "tis":
        stats["truncated_frac"] = truncated / tokens
    else:
        stats["masked_frac"] = masked / rows
    return weights, stats


def ragged(seed, B=12, T=23, scale=0.6, right_padded=True):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=gen, dtype=torch.float64) - 2
    sample = old + scale * torch.randn(B, T, generator=gen, dtype=torch.float64)
    if right_padded:
        lengths = torch.randint(0, T + 1, (B,), generator=gen)
        lengths[0] = T  # at least one valid token in the batch
        mask = (torch.arange(T) < lengths[:, None]).long()
    else:
        mask = (torch.rand(B, T, generator=gen) < 0.6).long()
        mask[0, 0] = 1
    # Padding holds garbage that must not reach anything.
    return torch.where(mask.bool(), old, float("nan")), torch.where(mask.bool(), sample, 1e4), mask


@pytest.mark.parametrize("right_padded", [True, False], ids=["right-padded", "arbitrary-mask"])
@pytest.mark.parametrize("mode,cap,low,high", [("tis", 2.0, 0.5, 2.0), ("tis", 1.2, 0.5, 2.0),
                                               ("mis", 2.0, 0.5, 2.0), ("mis", 2.0, 0.9, 1.1)])
def test_weights_and_diagnostics_match_a_slow_float64_reference(right_padded, mode, cap, low, high):
    for seed in range(3):
        old, sample, mask = ragged(seed, right_padded=right_padded)
        weights, stats = rollout_weights(old, sample, mask, mode, cap, low, high)
        ref_weights, ref_stats = reference_weights(old, sample, mask, mode, cap, low, high)
        # rollout_weights works in float32 (what it is given on the driver): float32 rounding
        assert (weights.double() - ref_weights).abs().max() < 1e-5
        assert stats.keys() == ref_stats.keys()
        for key, value in ref_stats.items():
            assert stats[key].item() == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert weights[~mask.bool()].abs().max() == 0


def test_tis_by_hand():
    # ratios 3, 0.5, 1 and padding: weights min(r, 2) = 2, 0.5, 1; one of three truncated;
    # ESS = (3.5)^2 / (3 * (4 + 0.25 + 1)) = 12.25 / 15.75
    old = torch.tensor([[math.log(3), math.log(0.5), 0.0, 5.0]])
    sample = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])
    weights, stats = rollout_weights(old, sample, mask, "tis", cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 1.0, 0.0]]))
    assert stats["truncated_frac"].item() == pytest.approx(1 / 3)
    assert stats["weight_mean"].item() == pytest.approx(3.5 / 3)
    assert stats["weight_max"].item() == pytest.approx(2.0)
    assert stats["ess"].item() == pytest.approx(12.25 / 15.75)
    kl = (3 - 1 - math.log(3)) + (0.5 - 1 - math.log(0.5))  # k3 at r = 1 is 0
    assert stats["kl_k3"].item() == pytest.approx(kl / 3)


def test_mis_keeps_or_drops_whole_sequences_by_their_geometric_mean_ratio():
    # geometric means: sqrt(3) (kept), 3 (above 2: dropped), sqrt(0.16) = 0.4 (below 0.5: dropped),
    # and a one-token row at ratio 1 (kept); half of the rows dropped, 4 of 7 tokens weighted 0
    old = torch.tensor([[math.log(3), 0.0], [math.log(9), 0.0], [math.log(0.16), 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    weights, stats = rollout_weights(old, torch.zeros(4, 2), mask, "mis", low=0.5, high=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]]))
    assert stats["masked_frac"].item() == pytest.approx(0.5)
    assert stats["weight_mean"].item() == pytest.approx(3 / 7)
    assert stats["ess"].item() == pytest.approx(3 / 7)  # 0/1 weights: (k)^2 / (N k) = k / N


def test_none_gives_no_weights_but_still_the_kl_between_rollout_and_trainer():
    old, sample, mask = ragged(0)
    weights, stats = rollout_weights(old, sample, mask, "none")
    assert weights is None
    assert set(stats) == {"kl_k3"} and stats["kl_k3"].item() > 0


def test_on_policy_samples_give_weight_one_and_full_ess():
    old, _, mask = ragged(1)
    for mode in ("tis", "mis"):
        weights, stats = rollout_weights(old, old, mask, mode)
        assert torch.equal(weights, mask.float())
        assert stats["ess"].item() == pytest.approx(1.0)
        assert stats["kl_k3"].item() == 0


def test_huge_ratios_stay_finite():
    old = torch.tensor([[500.0, -500.0, 0.0]])
    weights, stats = rollout_weights(old, torch.zeros(1, 3), torch.ones(1, 3), "tis", cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.0, 1.0]]))
    assert all(torch.isfinite(v) for v in stats.values())


def test_unknown_mode_names_the_allowed_values():
    with pytest.raises(ValueError, match="none, tis, mis"):
        rollout_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "seq")


# ----------------------------------------------------------------------------- in the policy loss


def loss_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    advantages = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4, [1] + [0] * 5])
    return logp, old, advantages, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_weights_multiply_each_tokens_clipped_loss_and_keep_the_denominators(agg):
    logp, old, advantages, mask = loss_inputs()
    weights = torch.rand(4, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    out = policy_loss(logp, old, advantages, mask, 0.2, 0.2, dual_clip=3.0, agg=agg, token_weights=weights)

    # the same loss from per-token surrogates, written out one token at a time
    rows = []
    for b in range(4):
        terms = []
        for t in range(6):
            if not mask[b, t]:
                continue
            r, a = math.exp(float(logp.detach()[b, t] - old[b, t])), float(advantages[b, t])
            token = max(-a * r, -a * min(max(r, 0.8), 1.2))
            if a < 0:
                token = min(token, -3.0 * a)
            terms.append(float(weights[b, t]) * token)
        rows.append(terms)
    if agg == "token-mean":
        expected = sum(map(sum, rows)) / int(mask.sum())
    elif agg == "seq-mean-token-mean":
        expected = sum(sum(r) / len(r) for r in rows) / 4
    else:
        expected = sum(map(sum, rows)) / 4
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)


def test_weights_are_constants_and_scale_the_gradient():
    logp, old, advantages, mask = loss_inputs(1)
    weights = torch.full((4, 6), 2.0, dtype=torch.float64, requires_grad=True)
    policy_loss(logp, old, advantages, mask, 0.2, 0.2, token_weights=weights).loss.backward()
    assert weights.grad is None  # detached: a constant importance weight
    weighted = logp.grad.clone()
    logp.grad = None
    policy_loss(logp, old, advantages, mask, 0.2, 0.2).loss.backward()
    torch.testing.assert_close(weighted, 2 * logp.grad)


def test_a_masked_sequence_gets_no_policy_gradient():
    logp, old, advantages, mask = loss_inputs(2)
    weights = mask.double().clone()
    weights[0] = 0
    policy_loss(logp, old, advantages, mask, 0.2, 0.2, token_weights=weights).loss.backward()
    assert torch.all(logp.grad[0] == 0) and torch.any(logp.grad[1] != 0)
