"""The MoE combine and the dispatch's backward as one Triton pass each, for `moe_rows.py` on CUDA.

`gather_sum` reads each token's k rows once and writes the token's row once (fp32 sum); `combine_backward` reads the
output gradient and the k expert rows of a token once, writes the k rows' gradients (each row of the permutation
exactly once, so no atomics) and the k router-weight gradients (fp32 dot products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024  # hidden columns per tile


@triton.jit
def _gather_sum_kernel(src_ptr, index_ptr, weight_ptr, out_ptr, num_cols, TOP_K: tl.constexpr,
                       HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token, tile): out[token, tile] = sum_j w[token, j] * src[index[token, j], tile]."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < num_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(index_ptr + token * TOP_K + j).to(tl.int64)
        values = tl.load(src_ptr + row * num_cols + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            values = values * tl.load(weight_ptr + token * TOP_K + j).to(tl.float32)
        acc += values
    tl.store(out_ptr + token * num_cols + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _combine_backward_kernel(grad_ptr, y_ptr, index_ptr, weight_ptr, grad_y_ptr, grad_weight_ptr, num_cols,
                             TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Program token: grad_y[index[token, j]] = w[token, j] * grad[token] and grad_w[token, j] = <grad[token],
    y[index[token, j]]> for every j, walking the hidden columns in tiles."""
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, K_PAD)
    dots = tl.zeros([K_PAD], dtype=tl.float32)
    for start in range(0, num_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < num_cols
        grad = tl.load(grad_ptr + token * num_cols + cols, mask=inside, other=0.0).to(tl.float32)
        for j in tl.static_range(TOP_K):
            row = tl.load(index_ptr + token * TOP_K + j).to(tl.int64)
            weight = tl.load(weight_ptr + token * TOP_K + j).to(tl.float32)
            y = tl.load(y_ptr + row * num_cols + cols, mask=inside, other=0.0).to(tl.float32)
            dots += tl.where(slots == j, tl.sum(grad * y, axis=0), 0.0)
            tl.store(grad_y_ptr + row * num_cols + cols, (grad * weight).to(grad_y_ptr.dtype.element_ty),
                     mask=inside)
    tl.store(grad_weight_ptr + token * TOP_K + slots, dots.to(grad_weight_ptr.dtype.element_ty),
             mask=slots < TOP_K)


def gather_sum(src: Tensor, index: Tensor, weights: Tensor | None) -> Tensor:
    """src [N, H] contiguous, index [T, k] (rows of src), weights [T, k] or None -> [T, H] in src's dtype."""
    num_tokens, top_k = index.shape
    num_cols = src.shape[-1]
    out = torch.empty(num_tokens, num_cols, dtype=src.dtype, device=src.device)
    if out.numel():
        index = index.contiguous()
        has_weights = weights is not None
        _gather_sum_kernel[(num_tokens, triton.cdiv(num_cols, BLOCK))](
            src.contiguous(), index, weights.contiguous() if has_weights else index, out, num_cols, TOP_K=top_k,
            HAS_WEIGHTS=has_weights, BLOCK=BLOCK, num_warps=4)
    return out


def combine_backward(grad: Tensor, y: Tensor, index: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """grad [T, H] and y [T*k, H] contiguous, index [T, k] = the rows of y each token combined, weights [T, k] ->
    (grad_y [T*k, H] in y's dtype, grad_weights [T, k] in the weights' dtype)."""
    num_tokens, top_k = index.shape
    grad_y = torch.empty_like(y)
    grad_weights = torch.empty(num_tokens, top_k, dtype=weights.dtype, device=weights.device)
    if num_tokens:
        _combine_backward_kernel[(num_tokens,)](
            grad, y, index.contiguous(), weights.contiguous(), grad_y, grad_weights, y.shape[-1], TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), BLOCK=BLOCK, num_warps=4)
    return grad_y, grad_weights
