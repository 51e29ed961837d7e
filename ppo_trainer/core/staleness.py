"""The lag schedule of asynchronous rollouts (``sampler.max_staleness``, issue 51). Weight version v
is the policy after PPO step v (0: the initial weights). Step s (from 1) updates version s-1; with a
lag of k it trains on samples generated from version ``behaviour_step(s, k)`` = max(0, s-1-k). The
schedule is a function of the step alone, not of how fast generation ran, so a run's staleness is
the same on every machine and a resumed run regenerates exactly what the uninterrupted one used.

With partial rollouts a weight push cuts the samples still generating: each token is then stale by the
version that sampled it, which can only be newer than the sample's start, so never above the lag."""

from __future__ import annotations

import torch


def behaviour_step(step: int, max_staleness: int) -> int:
    """The weight version whose samples step ``step`` trains on: max(0, step-1-max_staleness).
    max_staleness=0 is the lock-step loop, where step s samples with the weights after step s-1."""
    if step < 1 or max_staleness < 0:
        raise ValueError(f"behaviour_step needs step >= 1 and max_staleness >= 0, got {step} and {max_staleness}")
    return max(0, step - 1 - max_staleness)


def sample_staleness(step: int, versions: torch.Tensor) -> torch.Tensor:
    """Per sample, how many updates its generating policy (``versions`` [B], integers, each sample's
    recorded weight version) is behind the policy step ``step`` updates (version step-1); integer, >= 0."""
    lag = (step - 1) - versions.long()
    if bool((lag < 0).any()):
        raise ValueError(f"a sample of weight version {int(versions.max())} cannot train at step {step}: "
                         f"step {step} updates version {step - 1}")
    return lag


def staleness_metrics(step: int, versions: torch.Tensor) -> dict[str, float]:
    """``rollout/staleness/mean`` and ``/max`` of a step's samples (0 at step 1; at most max_staleness
    when the samples follow ``behaviour_step``)."""
    lag = sample_staleness(step, versions)
    return {"rollout/staleness/mean": int(lag.sum()) / lag.numel(), "rollout/staleness/max": float(lag.max())}


def token_staleness_metrics(step: int, versions: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Partial rollouts: ``rollout/staleness/mean`` and ``/max`` over a step's tokens (``versions``
    [B, T], integers, each token's recorded weight version; ``mask`` [B, T], 1 on the tokens that count,
    the response's), and ``rollout/staleness/cut_share``: the share of samples whose tokens span more
    than one version (cut by a weight push)."""
    valid = mask.bool()
    if not bool(valid.any()):
        raise ValueError(f"step {step}: no response token to measure the staleness of")
    lag = sample_staleness(step, versions[valid])
    highest = torch.where(valid, versions, torch.iinfo(versions.dtype).min).amax(dim=1)
    lowest = torch.where(valid, versions, torch.iinfo(versions.dtype).max).amin(dim=1)
    cut = (highest > lowest)[valid.any(dim=1)]
    return {"rollout/staleness/mean": int(lag.sum()) / lag.numel(), "rollout/staleness/max": float(lag.max()),
            "rollout/staleness/cut_share": int(cut.sum()) / cut.numel()}
