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

    `sum_grad_over_group`: this rank sees only part of what the weight touches (its sequence-parallel tokens, or its
    attention heads for q/k norms), so the weight's gradient is summed over TP. `compile`, `bitwise`: see
    `fast_paths`.
    """

    def __init__(self, size: int, eps: float, name: str, sum_grad_over_group: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32, compile: bool = False,
                 bitwise: bool = False) -> None:
        super().__init__()
        self.eps, self.compile, self.bitwise = eps, compile, bitwise
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        set_spec(self.weight, ShardSpec(name, (size,), sum_grad_over_group=sum_grad_over_group))

    def forward(self, x: Tensor) -> Tensor:
        if self.bitwise and x.is_cuda:
            return _BitwiseRMSNorm.apply(x, self.weight, self.eps)
        return elementwise(rms_norm, self.compile)(x, self.weight, self.eps)


class _BitwiseRMSNorm(torch.autograd.Function):
    """Forward: the batch-invariant kernel (one program per row), which also keeps each row's reciprocal RMS.
    Backward: both gradients from it in two Triton launches (`bitwise_kernels.rms_norm_backward`; the same function
    as the default path's autograd up to rounding: backward bits need not match anything): training is host-bound
    at small widths, where each launch counts."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        from shardrl.parallel.bitwise_kernels import rms_norm as invariant_rms_norm  # Triton: CUDA installs only

        rstd = x.new_empty(x.numel() // x.shape[-1], 1, dtype=torch.float32)
        out = invariant_rms_norm(x, weight, eps, rstd)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        from shardrl.parallel.bitwise_kernels import rms_norm_backward  # Triton: CUDA installs only

        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = rms_norm_backward(grad, x, weight, rstd)
        wants_x, wants_weight, _ = ctx.needs_input_grad
        return grad_x if wants_x else None, grad_weight if wants_weight else None, None
