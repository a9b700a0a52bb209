"""The row moves around an MoE layer's experts: each token copied to its k expert rows (dispatch), and each token's k
expert outputs summed by router weight (combine), with their one device switch.

Assignment a = t * k + j is token t's j-th expert choice; `order` [T*k] lists the assignments grouped by expert (row
r of the expert input holds assignment order[r]) and `inverse` is its inverse permutation. Both moves are gathers
whose backward is a gather too, never a scatter-add with atomics (the slowest kernel of a bf16 MoE step on H200).

On CUDA the combine and the dispatch's backward run as one Triton pass each (`moe_rows_kernel.py`): in torch ops the
combine is a gather, a broadcast product and a sum over k, each a pass over [T*k, H] rows, and its backward three
more; together with the dispatch's they took ~50 ms of a 0.64 s MoE training step on one H200 (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
from torch import Tensor


def gather_sum_reference(src: Tensor, index: Tensor, weights: Tensor | None) -> Tensor:
    """out [T, H] = sum_j weights[t, j] * src[index[t, j]] (weights None: 1) in torch ops, in src's dtype."""
    num_tokens, top_k = index.shape
    picked = src.index_select(0, index.flatten()).view(num_tokens, top_k, src.shape[-1])  # [T, k, H]
    if weights is not None:
        picked = picked * weights.unsqueeze(-1)
    return picked.sum(dim=1)


def _gather_sum(src: Tensor, index: Tensor, weights: Tensor | None) -> Tensor:
    if src.is_cuda:
        from shardrl.parallel.moe_rows_kernel import gather_sum  # Triton: CUDA installs only

        return gather_sum(src, index, weights)
    return gather_sum_reference(src, index, weights)


def combine_backward_reference(grad: Tensor, y: Tensor, order: Tensor, inverse: Tensor,
                               weights: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of `combine_rows` in torch ops: grad_y [T*k, H] (row r: weights[a] * grad[t] for its assignment
    a = order[r], t = a // k) and grad_weights [T, k] (<grad[t], y[inverse[a]]>)."""
    num_tokens, top_k = weights.shape
    hidden = y.shape[-1]
    picked = y.index_select(0, inverse).view(num_tokens, top_k, hidden)  # [T, k, H]
    grad_weights = (picked * grad.unsqueeze(1)).sum(dim=-1)  # [T, k]
    grad_y = (grad.unsqueeze(1) * weights.unsqueeze(-1)).view(num_tokens * top_k, hidden).index_select(0, order)
    return grad_y, grad_weights


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor, top_k: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.shape = (x.shape[0], top_k)
        return x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return _gather_sum(grad.contiguous(), inverse.view(ctx.shape), None), None, None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, order: Tensor, inverse: Tensor, weights: Tensor) -> Tensor:
        y = y.contiguous()
        ctx.save_for_backward(y, order, inverse, weights)
        return _gather_sum(y, inverse.view(weights.shape), weights)

    @staticmethod
    def backward(ctx, grad: Tensor):
        y, order, inverse, weights = ctx.saved_tensors
        grad = grad.contiguous()
        if y.is_cuda:
            from shardrl.parallel.moe_rows_kernel import combine_backward  # Triton: CUDA installs only

            grad_y, grad_weights = combine_backward(grad, y, inverse.view(weights.shape), weights)
        else:
            grad_y, grad_weights = combine_backward_reference(grad, y, order, inverse, weights)
        return grad_y, None, None, grad_weights


def dispatch_rows(x: Tensor, order: Tensor, inverse: Tensor, top_k: int) -> Tensor:
    """x [T, H] -> rows [T*k, H] with row r = x[order[r] // k]: every token once per expert it chose, grouped by
    expert. Backward: each token's gradient is the sum of its k rows' (one gather-sum)."""
    return _DispatchRows.apply(x, order, inverse, top_k)


def combine_rows(y: Tensor, order: Tensor, inverse: Tensor, weights: Tensor) -> Tensor:
    """y [T*k, H] expert outputs in dispatch order, weights [T, k] -> out [T, H] = sum_j weights[t, j] *
    y[inverse[t * k + j]] (fp32 sums on CUDA). Differentiable in y and weights."""
    return _CombineRows.apply(y, order, inverse, weights)
