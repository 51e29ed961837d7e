"""The Bradley-Terry objective of a reward model trained on preference pairs (InstructGPT, OpenRLHF's
`PairWiseLoss`, TRL's `RewardTrainer`), and the pairwise statistics a run reports.

| symbol | shape | meaning                                                        |
|--------|-------|----------------------------------------------------------------|
| r_c    | [N]   | the score of each pair's chosen response                       |
| r_r    | [N]   | the score of its rejected response                             |
| m      | [N]   | the margin the chosen must win by (0 without a margin column)  |

loss = mean over pairs of -log sigmoid(r_c - r_r - m) = mean softplus(-(r_c - r_r - m)): softplus is
the stable form (no log(0) when r_c << r_r). A pair counts as ranked right when r_c > r_r (a tie is
wrong: a model that scores everything alike has learned nothing), whatever its margin."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                       denominator: float | None = None) -> torch.Tensor:
    """Scalar: sum over the N pairs of -log sigmoid(chosen - rejected - margin), divided by
    `denominator` (the pairs of the whole mini-batch, for a micro-batch's share; None: N). chosen,
    rejected, margin [N], computed in float32 or wider."""
    dtype = torch.promote_types(chosen.dtype, torch.float32)  # bfloat16 scores: the loss in float32
    diff = chosen.to(dtype) - rejected.to(dtype)
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    return F.softplus(-diff).sum() / (len(chosen) if denominator is None else denominator)


def pairwise_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over N pairs that ranks and micro-batches add up (divide by the pair count for means):
    `correct` (pairs with chosen > rejected), `margin` (chosen - rejected), `chosen`, `rejected`;
    chosen, rejected [N]. Detached, float64."""
    c, r = chosen.detach().double(), rejected.detach().double()
    return {"correct": (c > r).double().sum(), "margin": (c - r).sum(), "chosen": c.sum(), "rejected": r.sum()}


def pairwise_metrics(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                     prefix: str = "val") -> dict[str, float]:
    """`<prefix>/pairwise_accuracy`, `/margin/mean` (mean chosen - rejected), `/loss` (Bradley-Terry,
    with `margin`), `/chosen_score/mean`, `/rejected_score/mean` and `/score/std` (over both sides)
    of N pairs; chosen, rejected, margin [N]."""
    c, r = chosen.double(), rejected.double()
    sums = pairwise_sums(c, r)
    n = len(c)
    return {f"{prefix}/pairwise_accuracy": float(sums["correct"]) / n, f"{prefix}/margin/mean": float(sums["margin"]) / n,
            f"{prefix}/loss": float(bradley_terry_loss(c, r, None if margin is None else margin.double())),
            f"{prefix}/chosen_score/mean": float(sums["chosen"]) / n,
            f"{prefix}/rejected_score/mean": float(sums["rejected"]) / n,
            f"{prefix}/score/std": float(torch.cat([c, r]).std(unbiased=False))}


def score_statistics(scores: torch.Tensor) -> dict[str, float]:
    """{"mean", "std", "count"} of [K] scores (std over the K, not K - 1: what a running normaliser
    that saw them would hold)."""
    s = scores.double()
    return {"mean": float(s.mean()), "std": float(s.std(unbiased=False)), "count": int(len(s))}
