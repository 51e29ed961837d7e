"""Rollout correction: the sampler draws from pi_rollout (another dtype, kernel or stale weights),
PPO's surrogate assumes pi_old; ``rho_t = pi_old / pi_rollout`` corrects that (Yao et al. 2025):

======  =====================================================================================
none    no weights
tis     token-level truncated IS: ``w_t = min(rho_t, cap)``
mis     sequence-level masked IS: ``w_t = 1`` on a sequence whose geometric-mean token ratio
        ``exp(mean_t log rho_t)`` lies in ``[low, high]``, else 0 (no policy loss), whatever
        its length
======  =====================================================================================

Both policies are fixed for the PPO step, so the [B, T] weights are computed once on the driver
and enter the loss as constants (``policy_loss(token_weights=)``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ppo_trainer.core.choices import ROLLOUT_CORRECTIONS
from ppo_trainer.core.losses import kl_penalty
from ppo_trainer.core.masked import masked_mean


@torch.no_grad()
def rollout_weights(
    old_logprobs: torch.Tensor, sample_logprobs: torch.Tensor, response_mask: torch.Tensor, mode: str, cap: float = 2.0,
    low: float = 0.5, high: float = 2.0,
) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
    """The weights of ``mode`` (None for ``none``) and their diagnostics (computed in log space, so
    a huge ratio never overflows):

    =================  ================================================================
    kl_k3              k3 estimate of KL(pi_rollout || pi_old) (every mode)
    weight_mean, _max  of the weights (tis, mis)
    truncated_frac     tokens with rho_t > cap (tis)
    masked_frac        sequences with valid tokens that were dropped (mis)
    ess                normalised effective sample size over the N valid tokens,
                       ``(sum w)^2 / (N * sum w^2)``: 1 for equal weights, 0 if all are 0
    =================  ================================================================
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; expected one of {', '.join(ROLLOUT_CORRECTIONS)}")
    valid = response_mask.bool()
    log_ratio = torch.where(valid, old_logprobs.float() - sample_logprobs.float(), 0)
    metrics = {"kl_k3": masked_mean(kl_penalty(sample_logprobs.float(), old_logprobs.float(), "k3"), valid)}
    if mode == "none":
        return None, metrics

    if mode == "tis":
        log_cap = math.log(cap)
        weights = torch.exp(log_ratio.clamp(max=log_cap))
        metrics["truncated_frac"] = masked_mean((log_ratio > log_cap).float(), valid)
    else:
        seq_log_ratio = masked_mean(log_ratio, valid, dim=-1)
        keep = (seq_log_ratio >= math.log(low)) & (seq_log_ratio <= math.log(high))
        weights = keep.unsqueeze(-1).float().expand_as(log_ratio)
        has_tokens = valid.any(dim=-1)
        metrics["masked_frac"] = masked_mean((~keep).float(), has_tokens)
    weights = torch.where(valid, weights, 0)

    total, square_total, count = weights.sum(), weights.square().sum(), valid.sum()
    metrics["weight_mean"] = total / count.clamp(min=1)
    metrics["weight_max"] = weights.max() if weights.numel() else weights.new_zeros(())
    metrics["ess"] = torch.where(square_total > 0, total.square() / (count * square_total).clamp(min=1e-30), 0.0)
    return weights, metrics
