"""Diagnostics that tell whether PPO is healthy: explained variance, clip fractions, approx KL,
the sampler-trainer logprob gap.

All are detached scalars over valid tokens only (``mask`` nonzero); every input is [B, T].
"""

from __future__ import annotations

import torch

from ppo_trainer.core.masked import masked_mean, masked_var


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[R - V] / Var[R] over valid tokens.

    1 means the critic predicts the returns exactly, 0 means it does no better than predicting
    their mean, negative means worse. Returns 0 when the returns are constant (nothing to explain),
    so the logged metric never turns into NaN. "Constant" allows for float rounding: returns
    A + V that are 0 in exact arithmetic (every score 0, gamma = lam = 1) come out of the GAE
    sums as noise of about eps x T x |V|, whose tiny variance would otherwise make the ratio
    explode (about -1e15 on such a batch of the tiny model).
    """
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(returns - values, mask)
    explained = 1 - var_residual / var_returns
    scale = torch.where(mask.bool(), values.abs() + returns.abs(), 0).max()
    rounding = torch.finfo(returns.dtype).eps * mask.shape[-1] * scale  # std of the sums' rounding error
    return torch.where(var_returns > rounding.square(), explained, torch.zeros_like(explained))


@torch.no_grad()
def clip_fraction(clipped: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of valid tokens on which a clip bound was active (``clipped``, bool; their gradient is cut)."""
    return masked_mean(clipped.float(), mask)


@torch.no_grad()
def approx_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(old || new) estimated as the mean of ``old_logprobs - logprobs`` (logged as actor/ppo_kl)."""
    return masked_mean(old_logprobs - logprobs, mask)


@torch.no_grad()
def logprob_gap_metrics(sample_logprobs: torch.Tensor, recomputed: torch.Tensor,
                        response_mask: torch.Tensor) -> dict[str, float]:
    """rollout/logprob_diff_max and _mean: absolute differences between the sampler's logprobs
    and the trainer's recomputed ones (0.0 when no token is valid). A large gap means the
    sampler's policy is not the trainer's (stale weights, dtype, sampling settings)."""
    diff = (sample_logprobs.float() - recomputed.float()).abs()[response_mask.bool()]
    if diff.numel() == 0:
        return {"rollout/logprob_diff_max": 0.0, "rollout/logprob_diff_mean": 0.0}
    return {"rollout/logprob_diff_max": diff.max().item(), "rollout/logprob_diff_mean": diff.mean().item()}
