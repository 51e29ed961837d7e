"""Length shaping of training rewards (validation scores stay unshaped): a penalty for responses
cut off at the token budget (TRL's missing_eos_penalty) and DAPO's soft overlong penalty. Each
returns the amount subtracted from each response's score, >= 0, in float64 (a logged mean of 0.2
reads 0.2)."""

from __future__ import annotations

import torch

from ppo_trainer.config.schema import RewardConfig


def truncation_penalty(truncated: torch.Tensor, penalty: float) -> torch.Tensor:
    """[B] `penalty` where the response hit the token budget without EOS or a stop string
    (`truncated` [B] bool), else 0."""
    return truncated.double() * penalty


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """[B] DAPO's soft overlong penalty of responses of `lengths` [B] tokens: 0 up to
    max_new_tokens - buffer tokens, then rising linearly to `factor` at max_new_tokens."""
    exceed = (lengths.double() - (max_new_tokens - buffer)).clamp(min=0)
    return exceed / buffer * factor


def penalties(truncated: torch.Tensor, lengths: torch.Tensor, max_new_tokens: int,
              cfg: RewardConfig) -> dict[str, torch.Tensor]:
    """The enabled penalties by metric name ([B] each): "truncation_penalty" with
    reward.truncation_penalty > 0, "overlong_penalty" with reward.overlong_buffer > 0.
    truncated: [B] bool; lengths: [B] response tokens (EOS included)."""
    out = {}
    if cfg.truncation_penalty > 0:
        out["truncation_penalty"] = truncation_penalty(truncated, cfg.truncation_penalty)
    if cfg.overlong_buffer > 0:
        out["overlong_penalty"] = overlong_penalty(lengths, max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
    return out
