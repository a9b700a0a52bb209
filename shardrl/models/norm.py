"""RMSNorm with a shard spec (replicated weight)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardrl.parallel.spec import ShardSpec, set_spec


class RMSNorm(nn.Module):
    """y = w * x / rms(x), normalised in fp32 and cast back before the weight is applied (as HF does).

    `sum_grad_over_tp`: this rank sees only part of what the weight touches (its sequence-parallel tokens, or its
    attention heads for q/k norms), so the weight's gradient is summed over TP.
    """

    def __init__(self, size: int, eps: float, name: str, sum_grad_over_tp: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        set_spec(self.weight, ShardSpec(name, (size,), sum_grad_over_tp=sum_grad_over_tp))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
