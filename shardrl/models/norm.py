"""RMSNorm with a shard spec (replicated weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardrl.models.fast_paths import elementwise
from shardrl.parallel.spec import ShardSpec, set_spec


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """w * x / rms(x), normalised in fp32 and cast back before the weight is applied (as HF does).

    `F.rms_norm` upcasts half-precision input itself (one fused kernel on CUDA instead of a cast, a square, a
    mean, an rsqrt, a multiply and a cast back); the weight is applied after it, in x's dtype, as HF does.
    """
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


class RMSNorm(nn.Module):
    """`rms_norm` with its weight as a parameter.

    `sum_grad_over_tp`: this rank sees only part of what the weight touches (its sequence-parallel tokens, or its
    attention heads for q/k norms), so the weight's gradient is summed over TP. `compile`: see `fast_paths`.
    """

    def __init__(self, size: int, eps: float, name: str, sum_grad_over_tp: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32, compile: bool = False) -> None:
        super().__init__()
        self.eps, self.compile = eps, compile
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        set_spec(self.weight, ShardSpec(name, (size,), sum_grad_over_tp=sum_grad_over_tp))

    def forward(self, x: Tensor) -> Tensor:
        return elementwise(rms_norm, self.compile)(x, self.weight, self.eps)
