"""Reductions over the valid (mask nonzero) elements of a tensor. ``x`` and ``mask`` share one
shape, typically [B, T]; ``mask`` may be bool, int or float.
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid elements, [] (or reduced along ``dim``); 0 where none is valid."""
    valid = mask.bool()
    total = torch.where(valid, x, 0).sum() if dim is None else torch.where(valid, x, 0).sum(dim)
    count = valid.sum() if dim is None else valid.sum(dim)
    return total / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance [] of ``x`` over all valid elements (Bessel-corrected when ``unbiased``); 0 when
    too few elements define it."""
    valid = mask.bool()
    centered = torch.where(valid, x - masked_mean(x, valid), 0)
    count = valid.sum()
    if unbiased:
        count = count - 1
    return centered.square().sum() / count.clamp(min=1)


def masked_center(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` shifted to mean 0 over valid elements, not scaled; 0 where masked. Whitening without
    the division by the std (OpenRLHF's ``no_std_norm``): advantages keep their size, so a batch
    whose rewards barely differ is not blown up to unit variance."""
    valid = mask.bool()
    return torch.where(valid, x - masked_mean(x, valid), 0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` shifted to mean 0 and scaled to unit variance over valid elements; 0 where masked."""
    return masked_center(x, mask) * torch.rsqrt(masked_var(x, mask) + WHITEN_EPS)
