"""Which prompt groups carry signal: DAPO's dynamic sampling (algorithm.filter_groups) drops the
groups whose samples all score the same, since a group baseline makes all their advantages zero."""

from __future__ import annotations

import torch


def groups_with_spread(scores: torch.Tensor, n: int) -> torch.Tensor:
    """scores: [B] finite, rows of one prompt adjacent (row i*n+j is sample j of prompt i), B % n == 0.
    Returns [B // n] bool: whether prompt i's n scores are not all equal. Exact comparison, no
    tolerance: two scores that differ at all give the group's samples different advantages."""
    grouped = scores.reshape(-1, n)
    return grouped.amax(dim=1) > grouped.amin(dim=1)


def group_rows(groups: torch.Tensor, n: int) -> torch.Tensor:
    """groups: [G] int64 prompt indices. Returns [G * n] int64: their rows, in group order."""
    return (groups[:, None] * n + torch.arange(n)).reshape(-1)
