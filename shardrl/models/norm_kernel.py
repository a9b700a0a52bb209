"""RMSNorm as Triton kernels on CUDA: bitwise mode's forward, and the backward of every training pass.

Why the backward: in torch ops it is a multiply's backward, a product, a column sum and the normalisation's
backward, then autograd's add of the residual stream's gradient: about twelve passes over the [T, H] activations.
Here it is one pass that recomputes each row's reciprocal RMS from x (already loaded), also adds the residual
stream's gradient, plus a small column sum of per-program partial weight gradients (fixed order, so deterministic).

The forward is batch invariant (one program per row, the whole row in one block), which bitwise mode needs; it
rounds as HF does (normalised in fp32, rounded to x's dtype, then times the weight). Outside bitwise mode training
keeps torch's forward, so that a pass with autograd and one without (old log-probs) compute the same activations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from shardrl.parallel.bitwise_kernels import rows_contiguous
from shardrl.parallel.triton_launch import FastKernel

BACKWARD_PROGRAMS = 528  # 4 per SM of an H200: enough rows in flight, few partial sums to add


@triton.jit(do_not_specialize=["num_cols"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, num_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    """Program row: y = w * (x / sqrt(mean(x^2) + eps) rounded to x's dtype), HF's order of roundings."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / num_cols + eps)
    normed = (x * inv).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=inside)


_RMS_NORM = FastKernel(_rms_norm_kernel)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., H] -> the same shape, normalised per row of H."""
    rows = rows_contiguous(x).reshape(-1, x.shape[-1])
    y = torch.empty_like(rows)
    if rows.shape[0]:
        _RMS_NORM.launch((rows.shape[0],), (rows, weight, y), (rows.shape[1], rows.stride(0), y.stride(0), eps), 4,
                         BLOCK=triton.next_power_of_2(rows.shape[1]))
    return y.view(x.shape)


@triton.jit(do_not_specialize=["num_rows", "num_cols", "rows_per_program"])
def _rms_norm_backward_kernel(x_ptr, w_ptr, grad_ptr, residual_ptr, grad_x_ptr, partial_ptr, num_rows, num_cols,
                              rows_per_program, stride_x, stride_grad, stride_residual, stride_grad_x, eps,
                              BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Program p, rows p * rows_per_program.. (BLOCK_R at a time): each row's reciprocal RMS (as the forward
    computes it), the input gradient of each row (plus the residual stream's gradient of that row when
    HAS_RESIDUAL), and the sum over its rows of grad * normed (the weight's gradient, normed rounded as in the
    forward) into partial[p], fp32."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < num_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    grad_w = tl.zeros((BLOCK,), dtype=tl.float32)
    first = program * rows_per_program
    for start in range(0, rows_per_program, BLOCK_R):
        rows = first + start + tl.arange(0, BLOCK_R)
        row_ok = rows < num_rows
        inside = row_ok[:, None] & col_ok[None, :]
        at = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + at * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + at * stride_grad + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / num_cols + eps)
        x_hat = x * rstd[:, None]
        grad_w += tl.sum(grad * x_hat.to(x_ptr.dtype.element_ty).to(tl.float32), axis=0)
        grad_normed = grad * w[None, :]
        mean = tl.sum(grad_normed * x_hat, axis=1) / num_cols
        grad_x = rstd[:, None] * (grad_normed - x_hat * mean[:, None])
        if HAS_RESIDUAL:
            grad_x += tl.load(residual_ptr + at * stride_residual + cols[None, :], mask=inside,
                              other=0.0).to(tl.float32)
        tl.store(grad_x_ptr + at * stride_grad_x + cols[None, :], grad_x.to(grad_x_ptr.dtype.element_ty),
                 mask=inside)
    tl.store(partial_ptr + program * num_cols + cols, grad_w, mask=col_ok)


@triton.jit(do_not_specialize=["num_rows", "num_cols"])
def _column_sum_kernel(partial_ptr, out_ptr, num_rows, num_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program c: out[cols of block c] = sum over the rows of partial [num_rows, num_cols] fp32, in row order."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < num_cols
    total = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, num_rows, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        inside = (rows < num_rows)[:, None] & col_ok[None, :]
        total += tl.sum(tl.load(partial_ptr + rows[:, None] * num_cols + cols[None, :], mask=inside, other=0.0), 0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


_RMS_NORM_BACKWARD = FastKernel(_rms_norm_backward_kernel)
_COLUMN_SUM = FastKernel(_column_sum_kernel)


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float, residual_grad: Tensor | None = None
                      ) -> tuple[Tensor, Tensor]:
    """The gradients of `rms_norm` (or torch's, the same function) w.r.t. x (plus `residual_grad`, the gradient x
    also gets from the residual stream, when given) and weight, in two launches."""
    rows, grad_rows = rows_contiguous(x).reshape(-1, x.shape[-1]), rows_contiguous(grad).reshape(-1, x.shape[-1])
    residual_rows = None if residual_grad is None else rows_contiguous(residual_grad).reshape(-1, x.shape[-1])
    num_rows, num_cols = rows.shape
    grad_x = torch.empty_like(rows)
    grad_weight = torch.empty_like(weight)
    block = triton.next_power_of_2(num_cols)
    block_r = min(64, max(1, 4096 // block))
    per_program = triton.cdiv(triton.cdiv(max(num_rows, 1), BACKWARD_PROGRAMS), block_r) * block_r
    programs = triton.cdiv(num_rows, per_program)
    partial = torch.empty(programs, num_cols, dtype=torch.float32, device=x.device)
    if num_rows:
        residual = grad_x if residual_rows is None else residual_rows
        _RMS_NORM_BACKWARD.launch((programs,), (rows, weight, grad_rows, residual, grad_x, partial),
                                  (num_rows, num_cols, per_program, rows.stride(0), grad_rows.stride(0),
                                   residual.stride(0), grad_x.stride(0), eps), 4 if block <= 2048 else 8,
                                  BLOCK_R=block_r, BLOCK=block, HAS_RESIDUAL=residual_rows is not None)
    _COLUMN_SUM.launch((triton.cdiv(num_cols, 64),), (partial, grad_weight), (programs, num_cols), 4,
                       BLOCK_R=32, BLOCK_C=64)
    return grad_x.view(x.shape), grad_weight
