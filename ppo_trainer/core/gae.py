"""Per-token rewards and Generalized Advantage Estimation (GAE) for right-padded responses
(shapes: see ``ppo_trainer.core``).
"""

from __future__ import annotations

import torch

from ppo_trainer.core.losses import kl_penalty as kl_estimate


@torch.no_grad()
def token_rewards(
    scores: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, response_mask: torch.Tensor,
    kl_coef: float, kl_penalty: str, turn_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r_t = -kl_coef * kl_t`` on every valid token, plus ``scores[b]`` on the row's last valid
    token (the EOS, or the last token of a truncated response), plus ``turn_rewards[b, t]`` (a
    multi-turn episode's environment rewards [B,T], each on its turn's last token; None: none).
    ``kl_t = losses.kl_penalty(old_logprobs, ref_logprobs, kl_penalty)``; ``ref_logprobs=None``
    means no penalty. Masked tokens (padding, a multi-turn episode's observations) get nothing.

    Returns ``(token_rewards [B,T], kl [B,T])``, both 0 on masked tokens.
    """
    valid = response_mask.bool()
    if ref_logprobs is None:
        kl = torch.zeros_like(old_logprobs)
    else:
        kl = torch.where(valid, kl_estimate(old_logprobs, ref_logprobs, kl_penalty), 0)
    rewards = -kl_coef * kl
    if turn_rewards is not None:
        rewards = rewards + torch.where(valid, turn_rewards.to(rewards.dtype), 0)

    positions = torch.arange(valid.shape[-1], device=valid.device)
    last = torch.where(valid, positions, -1).max(dim=-1).values
    score = torch.where(last >= 0, scores.to(rewards.dtype), 0)
    rewards.scatter_add_(1, last.clamp(min=0).unsqueeze(1), score.unsqueeze(1))
    return rewards, kl


def _reverse_scan(x: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """y[t] = x[t] + decay[t] * y[t + 1] with y[T] = 0, for x, decay [T, B]; returns y [T + 1, B].

    Time runs along dim 0 so every step reads and writes contiguous [B] rows, one kernel each.
    """
    y = x.new_zeros(x.shape[0] + 1, x.shape[1])
    xs, decays, ys = x.unbind(0), decay.unbind(0), y.unbind(0)
    for t in range(x.shape[0] - 1, -1, -1):
        torch.addcmul(xs[t], decays[t], ys[t + 1], out=ys[t])
    return y


@torch.no_grad()
def compute_gae(
    token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: ``delta_t = r_t + gamma * V(s_next) - V(s_t)``, ``A_t = delta_t + gamma * lam * A_next``,
    "next" the next valid token of the row (masked positions are skipped, so any mask works).
    ``lam``: one number or [B], one per sequence (``adaptive_lambda``).

    Returns ``(advantages [B,T], returns [B,T])``, 0 on padding.
    """
    valid = response_mask.bool()
    values = torch.where(valid, values, 0)
    valid_by_t = valid.T.contiguous()
    values_by_t = values.T.contiguous()
    rewards_by_t = torch.where(valid_by_t, token_rewards.T, 0)

    # Alignment: values[:, t] is V(s_t), the state *before* token t, so token t bootstraps from
    # the value before the next valid token; shifting this by one is the classic PPO-for-LLMs bug.
    # After the last valid token the episode is over (EOS, or cut off and scored as finished):
    # nothing is bootstrapped (V = 0). upcoming[t]: the first valid value at or after t (decay 0
    # keeps a valid position's own value, decay 1 passes the next one on through padding).
    upcoming = _reverse_scan(values_by_t, (~valid_by_t).to(values.dtype))
    deltas = torch.where(valid_by_t, rewards_by_t + gamma * upcoming[1:] - values_by_t, 0)

    # On a masked position delta is 0 and the decay 1, so A passes through it unchanged and the
    # valid token before it sees the next valid token's advantage.
    lam_by_row = torch.as_tensor(lam, dtype=values.dtype, device=values.device)  # [] or [B]
    decay = torch.where(valid_by_t, gamma * lam_by_row, 1.0)
    advantages = torch.where(valid, _reverse_scan(deltas, decay)[:-1].T, 0)
    returns = torch.where(valid, advantages + values, 0)
    return advantages, returns


def adaptive_lambda(response_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive lambda (Yue et al. 2025), [B]: ``clamp(1 - 1 / (alpha * l), 0, 1)``,
    ``l`` the row's valid tokens. A fixed lambda < 1 discounts a reward l tokens away by lambda^l;
    this keeps the sum of the GAE weights, 1 / (1 - lambda) = alpha * l, proportional to the length.
    """
    lengths = response_mask.bool().sum(dim=-1).float()
    return torch.clamp(1 - 1 / (alpha * lengths), 0, 1)
