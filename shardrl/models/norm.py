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
    `fast_paths`. On CUDA, bitwise mode and every pass that builds a graph (training) run the Triton kernels
    (`norm_kernel.py`: one pass forward, one backward); the forward-only pass without bitwise mode keeps torch's
    fused normalisation, which CUDA graphs capture as they are.
    """

    def __init__(self, size: int, eps: float, name: str, sum_grad_over_group: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32, compile: bool = False,
                 bitwise: bool = False) -> None:
        super().__init__()
        self.eps, self.compile, self.bitwise = eps, compile, bitwise
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        set_spec(self.weight, ShardSpec(name, (size,), sum_grad_over_group=sum_grad_over_group))

    def forward(self, x: Tensor) -> Tensor:
        if self._runs_kernel(x):
            return _KernelRMSNorm.apply(x, self.weight, self.eps, False)[0]
        return elementwise(rms_norm, self.compile)(x, self.weight, self.eps)

    def with_residual(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x), x) for a residual stream x that is also added to later: the x returned is the one to use
        there, so that on the kernel path the normalisation's backward adds the residual stream's gradient into
        x's gradient in its own pass (else autograd adds the two in a separate kernel)."""
        if self._runs_kernel(x):
            return _KernelRMSNorm.apply(x, self.weight, self.eps, True)
        return self(x), x

    def _runs_kernel(self, x: Tensor) -> bool:
        return x.is_cuda and (self.bitwise or (torch.is_grad_enabled() and not self.compile))


class _KernelRMSNorm(torch.autograd.Function):
    """Forward: the batch-invariant Triton kernel (`norm_kernel.rms_norm`), which also keeps each row's reciprocal
    RMS. Backward: both gradients from it in two Triton launches (the same function as torch's autograd up to
    rounding). With `pass_through` the input is also returned; its gradient (the residual stream's) is added into
    the input's gradient by the backward kernel."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, pass_through: bool) -> tuple[Tensor, ...]:
        from shardrl.models.norm_kernel import rms_norm as kernel_rms_norm  # Triton: CUDA installs only

        rstd = x.new_empty(x.numel() // x.shape[-1], 1, dtype=torch.float32)
        out = kernel_rms_norm(x, weight, eps, rstd)
        ctx.save_for_backward(x, weight, rstd)
        return (out, x) if pass_through else (out,)

    @staticmethod
    def backward(ctx, grad: Tensor, residual_grad: Tensor | None = None):
        from shardrl.models.norm_kernel import rms_norm_backward  # Triton: CUDA installs only

        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = rms_norm_backward(grad, x, weight, rstd, residual_grad)
        wants_x, wants_weight, _, _ = ctx.needs_input_grad
        return grad_x if wants_x else None, grad_weight if wants_weight else None, None, None
