"""PPO losses: clipped policy and value losses, KL penalties, aggregation, and the actor's and
critic's micro-batch losses built from them."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ppo_trainer.core.choices import AGG_MODES, KL_KINDS, POSITIVE_EXAMPLES
from ppo_trainer.core.metrics import approx_kl, clip_fraction

K3_BOUND = 10.0
LOG_RATIO_BOUND = 20.0  # exp(20) ~ 4.9e8: far past any clip, far below float32 overflow (~exp(88))

Count = int | float | torch.Tensor


class PolicyLossOutput(NamedTuple):
    """``loss`` carries the gradient; the rest are detached scalars for logging."""
    loss: torch.Tensor
    clipfrac: torch.Tensor  # actor/pg_clipfrac: tokens where the ratio clip was active
    approx_kl: torch.Tensor  # actor/ppo_kl


class ValueLossOutput(NamedTuple):
    """``loss`` carries the gradient; ``clipfrac`` (critic/vf_clipfrac) is a detached scalar."""
    loss: torch.Tensor
    clipfrac: torch.Tensor


def aggregate(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: Count | None = None,
    global_seqs: Count | None = None,
) -> torch.Tensor:
    """Reduce per-token losses ``loss_mat`` [B, T] over ``mask`` [B, T] to a scalar [].

    ======================  ===================================================================
    token-mean              sum of valid token losses / global_tokens
    seq-mean-token-mean     sum over rows of (row's mean valid token loss) / global_seqs
    seq-mean-token-sum      sum over rows of (row's summed valid token loss) / global_seqs
    ======================  ===================================================================

    The counts are the whole mini-batch's (all micro-batches and ranks), so the micro-batch losses
    sum to the full-batch loss; ``None``: the local count. Rows without valid tokens give 0.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
    valid = mask.bool()
    token_losses = torch.where(valid, loss_mat, 0)
    if mode == "token-mean":
        tokens = valid.sum().clamp(min=1) if global_tokens is None else global_tokens
        return token_losses.sum() / tokens
    seq_losses = token_losses.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / valid.sum(dim=-1).clamp(min=1)
    seqs = loss_mat.shape[0] if global_seqs is None else global_seqs
    return seq_losses.sum() / seqs


def policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    clip_low: float, clip_high: float, dual_clip: float | None = None, agg: str = "token-mean",
    global_tokens: Count | None = None, global_seqs: Count | None = None, token_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Clipped PPO surrogate, to be minimised, reduced by ``aggregate``.

    Per token: ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``, ``r = exp(logprobs -
    old_logprobs)``. With ``dual_clip = c > 1`` tokens with A < 0 are capped at ``-c * A`` (a huge
    ratio on a bad action would give an unbounded loss). ``token_weights`` [B, T] multiply each
    token's loss as constants; the denominators stay the counts.
    """
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    valid = response_mask.bool()
    logprobs = torch.where(valid, logprobs, 0)
    old_logprobs = torch.where(valid, old_logprobs, 0)
    advantages = torch.where(valid, advantages, 0)

    # Unclamped, a log-ratio above ~88 makes the ratio inf, and the clip's backward 0 * inf a NaN
    # gradient; at the bound the clip (or the dual clip) is active anyway.
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clipfrac = clip_fraction(clipped > unclipped, valid)

    if dual_clip is not None:
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, -advantages * dual_clip), loss_mat)
    if token_weights is not None:
        loss_mat = loss_mat * torch.where(valid, token_weights.detach(), 0)

    loss = aggregate(loss_mat, valid, agg, global_tokens, global_seqs)
    return PolicyLossOutput(loss, clipfrac, approx_kl(logprobs, old_logprobs, valid))


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor,
    clip: float | None = None, agg: str = "token-mean", global_tokens: Count | None = None,
    global_seqs: Count | None = None,
) -> ValueLossOutput:
    """Clipped value loss, reduced by ``aggregate``: per token ``0.5 * max((v - R)^2, (v_old +
    clip(v - v_old, -c, c) - R)^2)`` (a prediction that moved more than ``c`` from its rollout-time
    value gets no further gradient); ``clip=None``: ``0.5 * (v - R)^2``."""
    valid = response_mask.bool()
    values = torch.where(valid, values, 0)
    returns = torch.where(valid, returns, 0)

    loss_mat = (values - returns).square()
    clipfrac = torch.zeros((), device=loss_mat.device)
    if clip is not None:
        old_values = torch.where(valid, old_values, 0)
        clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped_mat = (clipped_values - returns).square()
        clipfrac = clip_fraction(clipped_mat > loss_mat, valid)
        loss_mat = torch.maximum(loss_mat, clipped_mat)

    loss = aggregate(0.5 * loss_mat, valid, agg, global_tokens, global_seqs)
    return ValueLossOutput(loss, clipfrac)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probabilities of sampled tokens;
    ``logprobs``, ``ref_logprobs`` and the result share one shape, typically [B, T].

    ======  ===============================================================================
    k1      logp - ref                      (unbiased, high variance, can be negative)
    abs     |logp - ref|
    k2      0.5 * (logp - ref)^2
    k3      exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]  (unbiased, >= 0,
            low variance)
    ======  ===============================================================================
    """
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        # k3 already exceeds the bound for |ref - logp| > 11; clamping the exponent first keeps
        # exp from overflowing to inf, whose backward (0 * inf) would turn gradients into NaN.
        log_ratio = torch.clamp(-diff, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -K3_BOUND, K3_BOUND)
    raise ValueError(f"unknown KL penalty kind {kind!r}; expected one of {', '.join(KL_KINDS)}")


def positive_examples(scores: torch.Tensor, groups: list[list[int]], rule: str, correct_score: float) -> torch.Tensor:
    """[B] bool: the responses the positive-example LM loss imitates, from their ``scores`` [B] and
    their prompts' ``groups`` (row indices, `Batch.prompt_groups`). ``correct``: score >=
    ``correct_score`` (VAPO's correct answers); ``group_best``: the top score of its group, when it
    is above the group's lowest (a group scored all alike has nothing to prefer), for rewards
    without a "correct" level such as a reward model's.
    """
    if rule not in POSITIVE_EXAMPLES:
        raise ValueError(f"unknown positive-example rule {rule!r}; expected one of {', '.join(POSITIVE_EXAMPLES)}")
    if rule == "correct":
        return scores >= correct_score
    positive = torch.zeros(scores.shape, dtype=torch.bool)
    for rows in groups:
        group = scores[rows]
        positive[rows] = (group == group.max()) & (group.max() > group.min())
    return positive


def positive_lm_loss(logprobs: torch.Tensor, positive: torch.Tensor, response_mask: torch.Tensor,
                     global_positive_tokens: Count) -> torch.Tensor:
    """VAPO's positive-example language-model loss, one micro-batch's share: minus the summed
    ``logprobs`` [B, T] of the valid tokens of the ``positive`` [B] rows over the mini-batch's
    positive tokens (all micro-batches and ranks), so the shares sum to the mean NLL per positive
    token; 0 when the mini-batch has none."""
    tokens = response_mask.bool() & positive.bool()[:, None]
    return -torch.where(tokens, logprobs, 0).sum() / max(float(global_positive_tokens), 1.0)


def actor_loss(
    logprobs: torch.Tensor, entropy: torch.Tensor | None, old_logprobs: torch.Tensor, advantages: torch.Tensor,
    response_mask: torch.Tensor, ref_logprobs: torch.Tensor | None, rollout_weights: torch.Tensor | None,
    algorithm: Any, global_tokens: Count, global_seqs: Count, positive: torch.Tensor | None = None,
    global_positive_tokens: Count = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the actor's loss: the clipped policy loss, minus entropy_coef x
    entropy when ``entropy`` [B, T] is given, plus kl_loss_coef x KL with use_kl_loss, plus
    positive_lm_loss_coef x `positive_lm_loss` of the ``positive`` [B] rows when the coefficient is > 0.

    Returns the loss and detached shares of pg_loss, pg_clipfrac, ppo_kl, and of update_entropy,
    kl_loss and positive_lm_loss when their term is on.
    """
    a, mask = algorithm, response_mask
    norm = {"global_tokens": global_tokens, "global_seqs": global_seqs}
    pg = policy_loss(logprobs, old_logprobs, advantages, mask, a.clip_ratio_low, a.clip_ratio_high, a.dual_clip,
                     a.loss_agg_mode, **norm, token_weights=rollout_weights)
    share = mask.sum() / global_tokens  # this micro-batch's part of the mini-batch's tokens
    loss = pg.loss
    stats = {"pg_loss": pg.loss.detach(), "pg_clipfrac": pg.clipfrac * share, "ppo_kl": pg.approx_kl * share}
    if entropy is not None:
        loss = loss - a.entropy_coef * aggregate(entropy, mask, a.loss_agg_mode, **norm)
        # the entropy of the policy being updated; actor/entropy (the trainer's old-logprob pass)
        # stays the entropy of the policy that sampled
        stats["update_entropy"] = aggregate(entropy.detach(), mask, "token-mean", global_tokens=global_tokens)
    if a.use_kl_loss:
        kl = aggregate(kl_penalty(logprobs, ref_logprobs, a.kl_loss_type), mask, a.loss_agg_mode, **norm)
        loss = loss + a.kl_loss_coef * kl
        stats["kl_loss"] = kl.detach()
    if a.positive_lm_loss_coef > 0:
        nll = positive_lm_loss(logprobs, positive, mask, global_positive_tokens)
        loss = loss + a.positive_lm_loss_coef * nll
        stats["positive_lm_loss"] = nll.detach()
    return loss, stats


def critic_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor,
    clip: float | None, agg: str, global_tokens: Count, global_seqs: Count,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the value loss and detached shares of vf_loss and vf_clipfrac."""
    out = value_loss(values, old_values, returns, response_mask, clip, agg, global_tokens, global_seqs)
    share = response_mask.sum() / global_tokens
    return out.loss, {"vf_loss": out.loss.detach(), "vf_clipfrac": out.clipfrac * share}
