"""Statistics over valid response tokens only (whole-batch helpers for advantages, KL penalty and diagnostics).

Masked positions (padding, tool-output tokens) may hold arbitrary values; every helper selects with `torch.where`
so nothing from them, not even a NaN, reaches a result.
"""

import torch

# Added to the variance before the reciprocal square root: a batch whose valid values are all equal whitens to 0.
WHITEN_EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is set, over `dim` (all dims when None)."""
    kept = torch.where(mask.bool(), values, 0.0)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is set; 0 where there are none."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(values - mean) / std over the valid positions of the whole batch `[B, T]`; 0 at masked positions.

    The variance is the unbiased (n-1) estimate, as verl users expect from its advantage whitening.
    """
    mean = masked_mean(values, mask)
    count = mask.bool().sum().clamp(min=2)
    variance = masked_sum((values - mean) ** 2, mask) / (count - 1)
    return torch.where(mask.bool(), (values - mean) * torch.rsqrt(variance + WHITEN_EPS), 0.0)
