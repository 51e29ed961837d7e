"""Diagnostics of PPO's health, detached scalars over the valid tokens of [B, T] inputs."""

from __future__ import annotations

import torch

from ppo_trainer.core.masked import masked_mean, masked_var


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[R - V] / Var[R]: 1 for a perfect critic, 0 for one no better than the mean.

    0 when the returns are constant up to float rounding: returns that are 0 in exact arithmetic
    come out of the GAE sums as noise of about eps x T x |V|, which would make the ratio explode
    (about -1e15 on such a batch of the tiny model).
    """
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(returns - values, mask)
    explained = 1 - var_residual / var_returns
    scale = torch.where(mask.bool(), values.abs() + returns.abs(), 0).max()
    rounding = torch.finfo(returns.dtype).eps * mask.shape[-1] * scale  # std of the sums' rounding error
    return torch.where(var_returns > rounding.square(), explained, torch.zeros_like(explained))


THIRDS = ("early", "middle", "late")


@torch.no_grad()
def value_error_by_third(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """critic/vf_error/early, /middle, /late: the mean of (V - R)^2 over the tokens in each third of
    their response, pooled over the batch; where along a response the critic fails. Thirds count
    a response's valid tokens only (a token masked inside a response has no position): valid token
    i of n lies in third floor(3 i / n), so one token is early, two are early and middle. NaN for a
    third without tokens (every response shorter than three tokens has no late third).
    """
    valid = mask.bool()
    position = valid.long().cumsum(dim=-1) - 1  # [B, T] index among the row's valid tokens
    third = torch.div(3 * position, valid.sum(dim=-1, keepdim=True).clamp(min=1), rounding_mode="floor")
    error = torch.where(valid, values.double() - returns.double(), 0).square()
    out = {}
    for k, name in enumerate(THIRDS):
        here = valid & (third == k)
        out[f"critic/vf_error/{name}"] = masked_mean(error, here).item() if here.any() else float("nan")
    return out


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
    """rollout/logprob_diff_max and _mean of |sampler's - trainer's logprobs| (0.0 without valid
    tokens); a large gap: stale weights, dtype or sampling settings differ."""
    diff = (sample_logprobs.float() - recomputed.float()).abs()[response_mask.bool()]
    if diff.numel() == 0:
        return {"rollout/logprob_diff_max": 0.0, "rollout/logprob_diff_mean": 0.0}
    return {"rollout/logprob_diff_max": diff.max().item(), "rollout/logprob_diff_mean": diff.mean().item()}
