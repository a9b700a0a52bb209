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
    attention heads for q/k norms), so the weight's gradient is summed over TP. `compile`, `bitwise`: see
    `fast_paths`.
    """

    def __init__(self, size: int, eps: float, name: str, sum_grad_over_tp: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32, compile: bool = False,
                 bitwise: bool = False) -> None:
        super().__init__()
        self.eps, self.compile, self.bitwise = eps, compile, bitwise
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        set_spec(self.weight, ShardSpec(name, (size,), sum_grad_over_tp=sum_grad_over_tp))

    def forward(self, x: Tensor) -> Tensor:
        if self.bitwise and x.is_cuda:
            return _BitwiseRMSNorm.apply(x, self.weight, self.eps)
        return elementwise(rms_norm, self.compile)(x, self.weight, self.eps)


class _BitwiseRMSNorm(torch.autograd.Function):
    """Forward: the batch-invariant kernel (one program per row). Backward: autograd through `rms_norm` recomputed
    (the same function up to rounding; backward bits need not match anything)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        from shardrl.parallel.bitwise_kernels import rms_norm as invariant_rms_norm  # Triton: CUDA installs only

        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return invariant_rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(wanted) for t, wanted in zip((x, weight), ctx.needs_input_grad)]
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(rms_norm(*inputs, ctx.eps), wanted, grad) if wanted else ())
        return *(next(grads) if t.requires_grad else None for t in inputs), None
