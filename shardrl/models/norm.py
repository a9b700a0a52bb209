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
    `fast_paths`. On CUDA every pass that builds a graph (training) takes its backward from a Triton kernel
    (`norm_kernel.py`: one pass, which also adds the residual stream's gradient with `with_residual`); the forward
    is torch's, as without autograd, so old log-probs and the training pass see the same activations. Bitwise mode
    runs the batch-invariant Triton forward in every pass.
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
            return _KernelRMSNorm.apply(x, self.weight, self.eps, self.bitwise, False)[0]
        return elementwise(rms_norm, self.compile)(x, self.weight, self.eps)

    def with_residual(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x), x) for a residual stream x that is also added to later: the x returned is the one to use
        there, so that on the kernel path the normalisation's backward adds the residual stream's gradient into
        x's gradient in its own pass (else autograd adds the two in a separate kernel)."""
        if self._runs_kernel(x):
            return _KernelRMSNorm.apply(x, self.weight, self.eps, self.bitwise, True)
        return self(x), x

    def _runs_kernel(self, x: Tensor) -> bool:
        return x.is_cuda and (self.bitwise or (torch.is_grad_enabled() and not self.compile))


class _KernelRMSNorm(torch.autograd.Function):
    """Forward: `rms_norm` (torch's ops, as every pass without autograd computes it), or with `bitwise` the
    batch-invariant Triton kernel (`norm_kernel.rms_norm`). Backward: both gradients in two Triton launches (the
    same function as torch's autograd up to rounding). With `pass_through` the input is also returned; its gradient
    (the residual stream's) is added into the input's gradient by the backward kernel."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, bitwise: bool, pass_through: bool) -> tuple[Tensor, ...]:
        if bitwise:
            from shardrl.models.norm_kernel import rms_norm as kernel_rms_norm  # Triton: CUDA installs only

            out = kernel_rms_norm(x, weight, eps)
        else:
            out = rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return (out, x) if pass_through else (out,)

    @staticmethod
    def backward(ctx, grad: Tensor, residual_grad: Tensor | None = None):
        from shardrl.models.norm_kernel import rms_norm_backward  # Triton: CUDA installs only

        x, weight = ctx.saved_tensors
        grad_x, grad_weight = rms_norm_backward(grad, x, weight, ctx.eps, residual_grad)
        wants_x, wants_weight, *_ = ctx.needs_input_grad
        return grad_x if wants_x else None, grad_weight if wants_weight else None, None, None, None
