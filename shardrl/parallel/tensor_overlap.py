"""Tensor-parallel linears whose collectives overlap compute. Same maths as the plain path in `tensor.py`
(`enter_tp` + `ColumnParallelLinear`s, `RowParallelLinear`), which the tests compare against; only the order of
the work changes. On NCCL a collective started with `async_op=True` runs on NCCL's own CUDA stream, so the GEMMs
issued after it run beside it, and `work.wait()` makes the compute stream wait only where the result is read.

* Column-parallel backward (`column_parallel`): the input gradient of every linear that reads x (q/k/v, gate/up)
  is summed first and its all-reduce (reduce-scatter with sequence parallelism) is started; the weight gradients,
  which need no communication, are computed while it runs.
* Row-parallel forward (`row_parallel`, `chunks > 1`): the tokens are cut into `chunks` pieces; the all-reduce
  (reduce-scatter) of piece i runs while the GEMM of piece i+1 does. With sequence parallelism every rank's token
  chunk is cut the same way, so each piece's reduce-scatter hands each rank the next rows of its own chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from shardrl.parallel.collectives import reduce_scatter_single
from shardrl.parallel.data import accumulate_weight_grad
from shardrl.parallel.tensor import (
    ColumnParallelLinear,
    Group,
    RowParallelLinear,
    Work,
    all_gather_tokens,
    apply_columns,
    enter_tp,
    has_adapter,
    group_rank,
    group_size,
    reduce_scatter_tokens,
    token_split_sizes,
)


@dataclass(frozen=True)
class TPOverlap:
    """How tensor-parallel collectives overlap compute; results do not depend on it beyond float rounding.

    backward: column-parallel backward starts the input-gradient collective before the weight-gradient GEMMs.
    chunks: row-parallel forward pipelines this many token pieces (1: one GEMM, then one collective).
    """

    backward: bool = True
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError(f"tp_comm_overlap_chunks={self.chunks}: must be at least 1 (1 = no forward pipelining)")


def column_parallel(x: Tensor, linears: Sequence[ColumnParallelLinear], group: Group, sequence_parallel: bool,
                    num_tokens: int, overlap: bool) -> list[Tensor]:
    """Enter the TP region with x [T, H] (or this rank's SP chunk) and apply every linear: [T, out_i/tp] each.

    Under autograd the backward sums the linears' input gradients in place, one GEMM adding into the last (autograd
    would add them in separate passes), and with a group it starts their collective before the weight gradients.
    Without autograd, with a LoRA adapter on any linear (this backward knows the base weights only), with a group
    but `overlap` off, or without a group for a single linear or bitwise GEMMs, this is `enter_tp` followed by the
    linears (one GEMM for all of them when an inference engine packed them, see `apply_columns`).
    """
    plain = group is None and (len(linears) == 1 or any(linear.bitwise for linear in linears))
    if plain or (group is not None and not overlap) or not torch.is_grad_enabled() or any(map(has_adapter, linears)):
        full = enter_tp(x, group, sequence_parallel, num_tokens)  # [T, H]
        return apply_columns(full, linears)
    has_bias = tuple(linear.bias is not None for linear in linears)
    params = [p for linear in linears for p in (linear.weight, linear.bias) if p is not None]
    return list(_ColumnParallel.apply(x, group, sequence_parallel, num_tokens, has_bias, *params))


def row_parallel(x: Tensor, linear: RowParallelLinear, chunks: int, residual: Tensor | None = None) -> Tensor:
    """`linear(x, residual)` for x [T, in/tp], with the forward collective pipelined over `chunks` token pieces
    (not with a LoRA adapter: it joins the partial sum before the one reduce)."""
    if linear.group is None or chunks == 1 or has_adapter(linear):
        return linear(x, residual)
    y = _RowParallelChunked.apply(x, linear.weight, linear.group, linear.sequence_parallel, chunks)
    y = y if linear.bias is None else y + linear.bias
    return y if residual is None else residual + y


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, sequence_parallel: bool, num_tokens: int,
                has_bias: tuple[bool, ...], *params: Tensor) -> tuple[Tensor, ...]:
        full = all_gather_tokens(x, group, num_tokens) if sequence_parallel and group is not None else x  # [T, H]
        params_iter = iter(params)
        weights, biases = [], []
        for bias in has_bias:
            weights.append(next(params_iter))
            biases.append(next(params_iter) if bias else None)
        ctx.save_for_backward(full, *weights)
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, has_bias
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        full, *weights = ctx.saved_tensors
        grad_full = grads[0].mm(weights[0])  # [T, H] = sum_i grad_i [T, out_i/tp] @ W_i [out_i/tp, H]
        for grad, weight in zip(grads[1:], weights[1:]):
            grad_full.addmm_(grad, weight)
        if ctx.group is None:
            grad_x, work = grad_full, None
        elif ctx.sequence_parallel:
            grad_x, work = reduce_scatter_tokens(grad_full, ctx.group, async_op=True)  # [T_r, H]
        else:
            grad_x, work = grad_full, dist.all_reduce(grad_full, group=ctx.group, async_op=True)
        grad_params = []  # runs while the collective does
        wants = iter(ctx.needs_input_grad[5:])
        for grad, weight, bias in zip(grads, weights, ctx.has_bias):
            # [out_i/tp, H], or None once added into the weight's main_grad
            grad_params.append(accumulate_weight_grad(weight, grad, full) if next(wants) else None)
            if bias:
                grad_params.append(grad.sum(0) if next(wants) else None)
        if work is not None:
            work.wait()
        return grad_x, None, None, None, None, *grad_params


class _RowParallelChunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, group: dist.ProcessGroup, sequence_parallel: bool,
                chunks: int) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sequence_parallel, ctx.num_tokens = group, sequence_parallel, x.shape[0]
        if sequence_parallel:
            return _pipelined_reduce_scatter(x, weight, group, chunks)
        y = x.new_empty(x.shape[0], weight.shape[0])  # [T, out]
        works: list[Work] = []
        start = 0
        for size in token_split_sizes(x.shape[0], chunks):
            rows = y[start:start + size]
            torch.mm(x[start:start + size], weight.t(), out=rows)
            if size:
                works.append(dist.all_reduce(rows, group=group, async_op=True))
            start += size
        for work in works:
            work.wait()
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        if ctx.sequence_parallel:  # grad [T_r, out] of this rank's tokens -> [T, out]
            grad = all_gather_tokens(grad.contiguous(), ctx.group, ctx.num_tokens)
        grad_x = grad.mm(weight) if ctx.needs_input_grad[0] else None  # [T, in/tp]
        grad_w = accumulate_weight_grad(weight, grad, x) if ctx.needs_input_grad[1] else None  # [out, in/tp]
        return grad_x, grad_w, None, None, None


def _pipelined_reduce_scatter(x: Tensor, weight: Tensor, group: dist.ProcessGroup, chunks: int) -> Tensor:
    """x [T, in/tp] @ W^T reduce-scattered into this rank's SP token chunk [T_r, out], one piece at a time.

    Piece j holds the j-th slice of every rank's token chunk, laid out rank after rank and padded to the largest
    slice, which is what `reduce_scatter_single` splits; padding rows are never written and only land in the
    padding of the outputs, which is dropped.
    """
    num_ranks, me = group_size(group), group_rank(group)
    rank_sizes = token_split_sizes(x.shape[0], num_ranks)
    rank_starts = [sum(rank_sizes[:r]) for r in range(num_ranks)]
    slices = [token_split_sizes(n, chunks) for n in rank_sizes]  # [rank][piece] rows
    offsets = [0] * num_ranks  # rows of each rank's chunk already sent
    pieces: list[Tensor] = []
    works: list[Work] = []
    for j in range(chunks):
        pad = max(sizes[j] for sizes in slices)
        if pad == 0:
            break
        send = x.new_empty(num_ranks * pad, weight.shape[0])  # [tp * pad, out]
        for r in range(num_ranks):
            first, size = rank_starts[r] + offsets[r], slices[r][j]
            torch.mm(x[first:first + size], weight.t(), out=send[r * pad: r * pad + size])
            offsets[r] += size
        out = x.new_empty(pad, weight.shape[0])  # [pad, out]
        works.append(reduce_scatter_single(out, send, group=group, async_op=True))
        pieces.append(out[:slices[me][j]])
    for work in works:
        work.wait()
    return torch.cat(pieces)
