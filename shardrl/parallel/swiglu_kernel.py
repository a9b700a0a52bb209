"""SwiGLU forward and backward as one Triton kernel each, for `activation.gated_silu` on CUDA.

Forward reads gate and up once and writes silu(gate) * up; backward reads gate, up and the output gradient once and
writes both input gradients, d up = g * silu(gate) and d gate = g * up * s * (1 + gate * (1 - s)) with s =
sigmoid(gate). All arithmetic is fp32; results are stored in the inputs' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 2048


@triton.jit
def _forward_kernel(gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, num_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < num_cols
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=inside, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * num_cols + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _backward_kernel(gate_ptr, up_ptr, grad_ptr, grad_gate_ptr, grad_up_ptr, stride_gate, stride_up, stride_grad,
                     num_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < num_cols
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=inside, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + row * stride_grad + cols, mask=inside, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    grad_up = grad * gate * sig
    grad_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(grad_up_ptr + row * num_cols + cols, grad_up.to(grad_up_ptr.dtype.element_ty), mask=inside)
    tl.store(grad_gate_ptr + row * num_cols + cols, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=inside)


def _rows(x: Tensor) -> Tensor:
    """[N, F] with unit column stride (projection outputs and their column slices are)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        gate, up = _rows(gate), _rows(up)
        num_rows, num_cols = gate.shape
        out = torch.empty(num_rows, num_cols, dtype=gate.dtype, device=gate.device)
        if out.numel():
            _forward_kernel[(num_rows, triton.cdiv(num_cols, BLOCK))](
                gate, up, out, gate.stride(0), up.stride(0), num_cols, BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        grad = _rows(grad)
        num_rows, num_cols = gate.shape
        grad_gate = torch.empty(num_rows, num_cols, dtype=gate.dtype, device=gate.device)
        grad_up = torch.empty(num_rows, num_cols, dtype=up.dtype, device=up.device)
        if grad_gate.numel():
            _backward_kernel[(num_rows, triton.cdiv(num_cols, BLOCK))](
                gate, up, grad, grad_gate, grad_up, gate.stride(0), up.stride(0), grad.stride(0), num_cols,
                BLOCK=BLOCK, num_warps=8)
        return grad_gate, grad_up


def fused_swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """gate, up [N, F] (same dtype) -> silu(gate) * up [N, F], contiguous, differentiable in both."""
    return _SwiGLU.apply(gate, up)
