"""Reductions over the valid (mask == 1) elements of a tensor.

Every function reads masked positions only through ``torch.where``, so whatever they hold
(padding garbage, inf, NaN) never reaches a result or a gradient.

Shapes: ``x`` and ``mask`` share one shape, typically [B, T]; ``mask`` may be bool, int or float
(nonzero = valid).
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid elements; 0 where there is no valid element.

    ============  ==========================================
    x, mask       [B, T] (any shape, the same for both)
    return        [] when ``dim`` is None, else ``x`` reduced along ``dim``
    ============  ==========================================
    """
    valid = mask.bool()
    total = torch.where(valid, x, 0).sum() if dim is None else torch.where(valid, x, 0).sum(dim)
    count = valid.sum() if dim is None else valid.sum(dim)
    return total / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all valid elements (Bessel-corrected when ``unbiased``).

    Returns 0 when there are too few valid elements to define it (0, or 1 if unbiased).

    ============  =====================
    x, mask       [B, T] (any shape)
    return        []
    ============  =====================
    """
    valid = mask.bool()
    centered = torch.where(valid, x - masked_mean(x, valid), 0)
    count = valid.sum()
    if unbiased:
        count = count - 1
    return centered.square().sum() / count.clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` shifted to mean 0 and scaled to unit variance over valid elements; 0 where masked.

    ============  =====================
    x, mask       [B, T] (any shape)
    return        [B, T]
    ============  =====================
    """
    valid = mask.bool()
    whitened = (x - masked_mean(x, valid)) * torch.rsqrt(masked_var(x, valid) + WHITEN_EPS)
    return torch.where(valid, whitened, 0)
